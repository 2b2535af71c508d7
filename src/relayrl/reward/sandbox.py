"""Run untrusted Python programs (model-written code) in a fresh, contained subprocess.

Every run gets a fresh process in its own session with a wall-clock timeout, after which
everything of the run is killed; resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE``, no core dumps); a private work
directory; a scrubbed environment (``PATH``, locale, a few Python settings). Its stdout and
stderr come back through pipes (the first ``max_output_bytes`` are kept; more than
``file_size_mb`` ends the run as ``output_limit`` unless ``output_limit=False``), and an
optional result pipe on descriptor 3 (``channel=True``).

How much the OS can do decides the isolation mode (``Sandbox.isolation``, probed once per
process, or forced with ``isolation=`` or ``RELAYRL_SANDBOX_ISOLATION``), strongest first:

``bwrap`` (bubblewrap installed; ``apt-get install bubblewrap``): the program runs under a
    fresh unprivileged uid in new user, pid, network, IPC, UTS and cgroup namespaces, with no
    nested user namespaces, a seccomp filter refusing keyrings, ptrace, mounts, namespaces and
    other kernel interfaces (x86_64), and a root made only of read-only ``/usr`` (``/bin``,
    ``/lib*``), the interpreter's prefix and the run's inputs, plus private ``/proc``,
    ``/dev`` and a size-limited ``/tmp``: the host's files, sockets, IPC objects and processes
    are out of sight and everything vanishes with the run. Where this process may create
    cgroups (root, v1 or delegated v2), memory, processes and CPU (one core) are limited over
    the whole sample, not per process, and CPU seconds are summed over all its processes.
``namespace`` (root with ``unshare``, no bwrap): new net/pid/mount namespaces, a private
    tmpfs ``/tmp``, a fresh uid per run; the host's world-readable files stay readable, and
    there is no IPC namespace.
``userns`` (non-root, user namespaces allowed): a network namespace; the rest as fallback.
``fallback``: rlimits, session and private directory, plus a Python audit-hook guard that
    is defence in depth, not a boundary. As root it runs the program under a fresh uid, and
    refuses to run when that uid cannot reach the interpreter.

The modes below ``bwrap`` log one warning per process saying how much weaker they are.
``Sandbox.run`` never raises for anything the program does: the outcome is a
``SandboxResult`` with a ``status`` and a human-readable ``reason``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from relayrl.reward import _sandbox_os as sos
from relayrl.reward._sandbox_os import processes_of_session, processes_of_uid

__all__ = [
    "IsolationMode",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "detect_isolation",
    "processes_of_session",
    "processes_of_uid",
    "remove_orphaned_dirs",
    "run_python",
]

log = logging.getLogger(__name__)

IsolationMode = Literal["bwrap", "namespace", "userns", "fallback"]
MODES = ("bwrap", "namespace", "userns", "fallback")
SandboxStatus = Literal[
    "ok",
    "error",
    "timeout",
    "cpu_limit",
    "memory_limit",
    "output_limit",
    "process_limit",
    "killed",
    "sandbox_error",
]

_BOOT = Path(__file__).with_name("_sandbox_boot.py")
_RUNNER = Path(__file__).with_name("_sandbox_runner.py")
BOOT_FAILED = 197
CHANNEL_BYTES = 16 << 20
WEAKER = {
    "namespace": (
        "sandbox isolation 'namespace' (bubblewrap not found): no IPC namespace, the host's "
        "world-readable files stay readable, limits are per process; install bubblewrap"
    ),
    "userns": (
        "sandbox isolation 'userns': only the network is namespaced; the program can read "
        "what this user can read; install bubblewrap"
    ),
    "fallback": (
        "sandbox isolation 'fallback': no namespaces; rlimits and a Python audit hook only "
        "(defence in depth, not a boundary); install bubblewrap"
    ),
}


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        cpu_s: CPU seconds per process (``RLIMIT_CPU``), and over the whole sample where
            cgroups are available.
        wall_s: wall-clock seconds for the whole run, start-up included.
        memory_mb: address space per process (``RLIMIT_AS``), and resident memory of the
            whole sample where cgroups are available.
        file_size_mb: largest file a process may write; also the most stdout/stderr bytes
            a run may write before it is stopped as ``output_limit``.
        disk_mb: size of the private ``/tmp`` (``bwrap`` and ``namespace`` modes).
        max_processes: processes (and threads, under cgroups) the program may have at once.
        max_open_files: ``RLIMIT_NOFILE``.
        max_output_bytes: stdout / stderr bytes kept in the result (each).
    """

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 16
    disk_mb: int = 64
    max_processes: int = 32
    max_open_files: int = 64
    max_output_bytes: int = 65536

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")
        if self.memory_mb < 32:
            raise ValueError("SandboxLimits.memory_mb must be >= 32 (the interpreter needs it)")
        if self.max_open_files < 16:
            raise ValueError("SandboxLimits.max_open_files must be >= 16")


@dataclass
class SandboxResult:
    """What happened to one program.

    ``status``: ``ok`` (exit code 0), ``error`` (non-zero exit), ``timeout`` (wall clock),
    ``cpu_limit``, ``memory_limit``, ``output_limit``, ``process_limit`` (could not fork),
    ``killed`` (by a signal), ``sandbox_error`` (the sandbox itself could not start the
    program). ``reason`` says it in words (None when ok). ``channel``: what the program wrote
    on descriptor 3 (``channel=True``); ``stdout_bytes``: all stdout bytes it wrote.
    """

    status: SandboxStatus
    returncode: int | None
    stdout: str
    stderr: str
    reason: str | None
    wall_s: float
    isolation: IsolationMode
    uid: int | None = None
    leftover_killed: int = 0
    channel: bytes = b""
    stdout_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------------------------------------
# isolation probing

_probe_lock = threading.Lock()
_probed: dict[str, IsolationMode] = {}
_warned: set[str] = set()


def _probe(cmd: list[str], code: str) -> bool:
    if shutil.which(cmd[0]) is None:
        return False
    try:
        r = subprocess.run(
            [*cmd, sys.executable, "-I", "-S", "-c", code],
            capture_output=True,
            timeout=20,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and b"relayrl-ok" in r.stdout


def _probe_bwrap() -> bool:
    """A whole trivial run in bwrap mode succeeds (bwrap present, namespaces allowed)."""
    if sos.bwrap_path() is None:
        return False
    box = Sandbox(SandboxLimits(wall_s=20, cpu_s=10), isolation="bwrap")
    r = box.run("print('relayrl-ok')")
    if not (r.ok and r.stdout.strip() == "relayrl-ok"):
        log.info("bubblewrap is installed but does not work here: %s", r.reason or r.stderr)
        return False
    return True


def detect_isolation() -> IsolationMode:
    """The strongest isolation mode this process can use (probed once, then cached).

    ``RELAYRL_SANDBOX_ISOLATION`` (``bwrap`` / ``namespace`` / ``userns`` / ``fallback``)
    overrides it.
    """
    forced = os.environ.get("RELAYRL_SANDBOX_ISOLATION", "").strip()
    if forced:
        if forced not in MODES:
            raise ValueError(
                f"RELAYRL_SANDBOX_ISOLATION={forced!r}: expected bwrap, namespace, userns or "
                "fallback"
            )
        return forced  # type: ignore[return-value]
    with _probe_lock:
        if "mode" in _probed:
            return _probed["mode"]
        mode: IsolationMode = "fallback"
        if sys.platform.startswith("linux"):
            if _probe_bwrap():
                mode = "bwrap"
            elif os.geteuid() == 0:
                uid = sos.fresh_uid()
                code = (
                    "import ctypes,os\n"
                    "l=ctypes.CDLL(None,use_errno=True)\n"
                    "assert l.mount(b'tmpfs',b'/tmp',b'tmpfs',0,b'size=1m')==0\n"
                    f"os.setgroups([]);os.setgid({uid});os.setuid({uid})\n"
                    "print('relayrl-ok')\n"
                )
                if _probe(_namespace_cmd(), code):
                    mode = "namespace"
            if mode == "fallback" and _probe(_userns_cmd(), "print('relayrl-ok')"):
                mode = "userns"
        _probed["mode"] = mode
        return mode


def _warn_once(mode: str) -> None:
    if mode in WEAKER and mode not in _warned:
        _warned.add(mode)
        log.warning(WEAKER[mode])


def _namespace_cmd() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _userns_cmd() -> list[str]:
    return ["unshare", "--user", "--map-current-user", "--net"]


def _reachable_by_others(path: str) -> bool:
    """Whether a uid with no rights of its own can execute ``path`` (every dir o+x)."""
    p = Path(path)
    try:
        if not os.stat(p).st_mode & 0o001:
            return False
        return all(os.stat(d).st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


def _read_tail(data: bytes, n: int = 4096) -> str:
    return data[-n:].decode("utf-8", errors="replace")


def _rmtree(path: Path) -> None:
    def onerror(func, p, exc_info):  # a program may have made its files read-only
        with contextlib.suppress(OSError):
            os.chmod(p, 0o700)
            os.chmod(os.path.dirname(p), 0o700)
            func(p)

    shutil.rmtree(path, onerror=onerror)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


class _Stream(threading.Thread):
    """Drains one pipe: keeps the first ``keep`` bytes, counts all, calls ``over()`` once
    more than ``limit`` bytes were written (``limit=None``: never)."""

    def __init__(self, fd: int, keep: int, limit: int | None, over) -> None:
        super().__init__(daemon=True, name="sandbox-stream")
        self.fd, self.keep, self.limit, self.over = fd, keep, limit, over
        self.chunks: list[bytes] = []
        self.kept = self.total = 0
        self.tail = b""
        self.exceeded = False

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    break
                self.total += len(chunk)
                if self.kept < self.keep:
                    self.chunks.append(chunk[: self.keep - self.kept])
                    self.kept += len(self.chunks[-1])
                self.tail = (self.tail + chunk)[-4096:]
                if self.limit is not None and self.total > self.limit and not self.exceeded:
                    self.exceeded = True
                    self.over()

    def text(self) -> str:
        text = b"".join(self.chunks).decode("utf-8", errors="replace")
        if self.total > self.kept:
            text += f"\n... [{self.total - self.kept} more bytes not kept]"
        return text


# ---------------------------------------------------------------------------------------------
# the sandbox


@dataclass
class Sandbox:
    """A reusable sandbox configuration; each ``run`` is a fresh process and directory.

    Args:
        limits: resource limits of each run.
        isolation: ``"auto"`` (probe), or force ``"bwrap"``, ``"namespace"``, ``"userns"``,
            ``"fallback"``.
        tmp_root: where the per-run host directories are created (default the system's).
        python: interpreter for the program (default: this one's base interpreter, so only
            the standard library is importable).
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    isolation: Literal["auto", "bwrap", "namespace", "userns", "fallback"] = "auto"
    tmp_root: str | None = None
    python: str | None = None

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", *MODES):
            raise ValueError(f"unknown sandbox isolation {self.isolation!r}")

    @property
    def mode(self) -> IsolationMode:
        return detect_isolation() if self.isolation == "auto" else self.isolation

    def _interpreter(self) -> tuple[str, str]:
        if self.python is not None:
            exe = os.path.realpath(self.python)
            return exe, str(Path(exe).parent.parent)
        exe = getattr(sys, "_base_executable", None) or sys.executable
        return os.path.realpath(exe), sys.base_prefix

    def run(
        self,
        code: str,
        *,
        stdin: str | bytes = "",
        files: dict[str, str] | None = None,
        argv: list[str] | None = None,
        channel: bool = False,
        capture_bytes: int | None = None,
        output_limit: bool = True,
    ) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh sandbox; never raises for program faults.

        Args:
            code: the program's source.
            stdin: its standard input (through a pipe).
            files: extra files to create in its work directory (relative path -> text).
            argv: its ``sys.argv[1:]``.
            channel: give the program a pipe on descriptor 3; what it writes there comes
                back as ``SandboxResult.channel`` (at most ``CHANNEL_BYTES``).
            capture_bytes: stdout bytes to keep (default ``limits.max_output_bytes``).
            output_limit: stop the run once it wrote more than ``file_size_mb`` MiB of
                stdout/stderr; False: drain and drop any amount (the wall clock still holds).
        """
        mode = self.mode
        _warn_once(mode)
        limits = self.limits
        t0 = time.monotonic()

        def error(reason: str) -> SandboxResult:
            return SandboxResult("sandbox_error", None, "", "", reason, 0.0, mode)

        if not isinstance(code, str):
            return error("program is not a string")
        files = dict(files or {})
        for name in files:
            norm = os.path.normpath(name)
            if norm.startswith("..") or os.path.isabs(norm) or norm == "main.py":
                return error(f"bad file name {name!r}")
        files["main.py"] = code
        exe, prefix = self._interpreter()
        root = os.geteuid() == 0
        if mode == "fallback" and root and not _reachable_by_others(exe):
            return error(
                "fallback isolation refuses to run as root: the sandbox uid cannot reach "
                f"the interpreter {exe}; install bubblewrap or pass python="
            )
        hostdir = Path(tempfile.mkdtemp(prefix=f"relayrl-sbx-{os.getpid()}-", dir=self.tmp_root))
        os.chmod(hostdir, 0o700 if mode == "namespace" else 0o711)
        if mode == "fallback" and root and not _reachable_by_others(str(hostdir)):
            _rmtree(hostdir)
            return error(
                "fallback isolation refuses to run as root: the sandbox uid cannot reach "
                f"the run directory under {hostdir.parent}; use a tmp_root others may enter"
            )
        run = _Run(self, mode, limits, hostdir, exe, prefix, root)
        try:
            return run.go(code, files, stdin, argv, channel, capture_bytes, output_limit, t0)
        except Exception as exc:  # the sandbox itself failed: report, never raise
            run.kill()
            return SandboxResult(
                "sandbox_error",
                None,
                "",
                "",
                f"{type(exc).__name__}: {exc}",
                time.monotonic() - t0,
                mode,
                run.uid,
                run.cleanup(),
            )
        finally:
            run.cleanup()
            run.close_fds()
            _rmtree(hostdir)


class _Run:
    """One run's state: its process, uid, cgroups, pipes; ``cleanup`` leaves nothing."""

    def __init__(self, box, mode, limits, hostdir, exe, prefix, root) -> None:
        self.box, self.mode, self.limits, self.hostdir = box, mode, limits, hostdir
        self.exe, self.prefix, self.root = exe, prefix, root
        self.proc: subprocess.Popen | None = None
        self.uid: int | None = None
        self.cg: sos.RunCgroups | None = None
        self.fds: list[int] = []
        self.cleaned: int | None = None
        self.killed_by_us = False
        self.oom = False

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.cg is not None:
            for pid in self.cg.procs():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)

    def cleanup(self) -> int:
        """Kill everything of the run (process group, uid, session, cgroup); count the kills."""
        if self.cleaned is not None:
            return self.cleaned
        n = 0
        if self.proc is not None:
            self.kill()
            with contextlib.suppress(Exception):
                self.proc.wait(timeout=10)
            if self.uid is not None:
                uid = self.uid
                n += sos.sweep(lambda: processes_of_uid(uid))
            else:
                pid = self.proc.pid
                n += sos.sweep(lambda: processes_of_session(pid))
        if self.cg is not None:
            self.oom = self.cg.oom_killed()  # read before the cgroup goes
            n += self.cg.remove()
        self.cleaned = n
        return n

    def close_fds(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    def _boot_config(self, files, channel_fd, argv) -> dict:
        mode, limits, hostdir = self.mode, self.limits, self.hostdir
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        cfg: dict = {
            "mode": mode,
            "private_tmp": mode == "namespace",
            "uid": self.uid,
            "files": files,
            "runner": _RUNNER.read_text(encoding="utf-8"),
            "runner_args": [],
            "argv": ["main.py", *(argv or [])],
            "limits": asdict(limits),
            "python": self.exe,
            "prefix": self.prefix,
            "env": env,
            "channel_fd": channel_fd,
            "cgroup_procs": self.cg.procs_files if self.cg is not None else [],
        }
        if mode == "userns":
            cfg["runner_args"] = ["--guard-fs", "--guard-kill"]
        elif mode == "fallback":
            cfg["runner_args"] = ["--guard-net", "--guard-fs", "--guard-kill"]
            if self.root and self.uid is None:
                cfg["runner_args"].append("--guard-proc")
        if mode == "bwrap":
            inbox = hostdir / "in"
            (inbox / "files").mkdir(parents=True, mode=0o755)
            for name, text in files.items():
                path = inbox / "files" / name
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
                path.write_text(text, encoding="utf-8")
                os.chmod(path, 0o644)
            (inbox / "runner.py").write_text(cfg.pop("runner"), encoding="utf-8")
            os.chmod(inbox / "runner.py", 0o644)
            cfg["files"] = {}
            # as root the boot re-mounts the inputs and the interpreter's prefix under a
            # private /tmp that the sandbox uid can traverse (the originals may sit in 0700
            # directories such as /root or pytest's tmp)
            in_usr = self.exe.startswith("/usr/")
            stage: dict[str, str] = {}
            inbox_src, prefix_src = str(inbox), self.prefix
            if self.root:
                inbox_src = stage[str(inbox)] = "/tmp/relayrl-in"
                if not in_usr:
                    prefix_src = stage[self.prefix] = "/tmp/relayrl-python"
            env = {**env, "HOME": "/tmp/work", "TMPDIR": "/tmp/work"}
            cfg["bwrap"] = sos.bwrap_argv(
                uid=self.uid or os.geteuid(),
                prefix=None if in_usr else self.prefix,
                prefix_src=None if in_usr else prefix_src,
                inbox=inbox_src,
                disk_mb=limits.disk_mb,
                env=env,
                seccomp_fd=None,
            )
            cfg["stage"] = stage
            cfg["seccomp"] = (sos.seccomp_filter() or b"").hex()
            cfg["command"] = [
                self.exe,
                "-I",
                "-B",
                "/.relayrl/runner.py",
                "--copy",
                "/.relayrl/files",
                "/tmp/work",
                "--",
                *cfg["argv"],
            ]
        return cfg

    def go(self, code, files, stdin, argv, channel, capture_bytes, output_limit, t0):
        mode, limits, hostdir = self.mode, self.limits, self.hostdir
        if mode in ("bwrap", "namespace") or (mode == "fallback" and self.root):
            self.uid = sos.fresh_uid() if self.root else None
        if mode == "bwrap":
            cg_name = f"relayrl-{os.getpid()}-{hostdir.name[-8:]}"
            self.cg = sos.RunCgroups(cg_name, limits.memory_mb, limits.max_processes + 4)
        chan_r = chan_w = None
        if channel:
            chan_r, chan_w = os.pipe()
            self.fds += [chan_r, chan_w]
        boot = self._boot_config(files, chan_w, argv)
        boot_path = hostdir / "boot.json"
        boot_path.write_text(json.dumps(boot), encoding="utf-8")
        os.chmod(boot_path, 0o600)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.fds += [out_r, out_w, err_r, err_w]
        data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
        guard_parent = sos.pdeathsig_prefix()
        self.proc = subprocess.Popen(
            [*guard_parent, *self._wrapper(), sys.executable, "-I", "-S", str(_BOOT), str(hostdir)],
            stdin=subprocess.PIPE,
            stdout=out_w,
            stderr=err_w,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            cwd=str(hostdir),
            start_new_session=True,
            close_fds=True,
            pass_fds=() if chan_w is None else (chan_w,),
        )
        for fd in (out_w, err_w, chan_w):
            if fd is not None:
                os.close(fd)
                self.fds.remove(fd)

        def over() -> None:
            self.kill()

        fsize = limits.file_size_mb * 1024 * 1024
        keep = limits.max_output_bytes if capture_bytes is None else int(capture_bytes)
        out = _Stream(out_r, keep, fsize if output_limit else None, over)
        err = _Stream(err_r, limits.max_output_bytes, fsize if output_limit else None, over)
        streams = [out, err]
        if chan_r is not None:
            streams.append(_Stream(chan_r, CHANNEL_BYTES, None, lambda: None))
        for s in streams:
            s.start()
        _feed(self.proc, data)
        cpu_over = self._wait(t0)
        rc = self.proc.returncode
        leftover = self.cleanup()  # nothing of the run is left: the pipes reach their end
        for s in streams:
            s.join(timeout=2.0)
        wall = time.monotonic() - t0
        status, reason = _classify(
            rc,
            self.killed_by_us,
            cpu_over,
            self.oom,
            out.exceeded or err.exceeded,
            _read_tail(err.tail),
            limits,
        )
        return SandboxResult(
            status,
            rc,
            out.text(),
            err.text(),
            reason,
            wall,
            mode,
            self.uid,
            leftover,
            b"".join(streams[2].chunks) if chan_r is not None else b"",
            out.total,
        )

    def _wrapper(self) -> list[str]:
        """The namespace tool the boot runs under (its mounts must never reach the host)."""
        if self.mode == "namespace":
            return _namespace_cmd()
        if self.mode == "userns":
            return _userns_cmd()
        return []

    def _wait(self, t0: float) -> bool:
        """Wait for the run's end, the wall clock, or (cgroups) the sample's CPU seconds."""
        assert self.proc is not None
        limits = self.limits
        while True:
            remaining = limits.wall_s - (time.monotonic() - t0)
            if remaining <= 0:
                self.killed_by_us = True
                self.kill()
                self.proc.wait()
                return False
            try:
                self.proc.wait(timeout=min(remaining, 0.05 if self.cg else remaining))
                return False
            except subprocess.TimeoutExpired:
                pass
            if self.cg is not None:
                used = self.cg.cpu_seconds()
                if used is not None and used > limits.cpu_s + 0.5:
                    self.kill()
                    self.proc.wait()
                    return True


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    """Write stdin without ever blocking the caller on a program that does not read."""
    assert proc.stdin is not None
    pipe = proc.stdin

    def write() -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            pipe.write(data)
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            pipe.close()

    if len(data) <= 32768:
        write()  # fits in the pipe buffer
    else:
        threading.Thread(target=write, daemon=True, name="sandbox-stdin").start()


def _classify(
    rc: int | None,
    killed_by_us: bool,
    cpu_over: bool,
    oom: bool,
    output_over: bool,
    err_tail: str,
    limits: SandboxLimits,
) -> tuple[SandboxStatus, str | None]:
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if killed_by_us:
        return "timeout", f"timeout: still running after {limits.wall_s:g} s wall clock"
    if cpu_over:
        return "cpu_limit", f"cpu limit: more than {limits.cpu_s:g} s of CPU time"
    if output_over or "File too large" in err_tail or sig == signal.SIGXFSZ:
        return "output_limit", f"output limit: more than {limits.file_size_mb} MiB written"
    if rc == BOOT_FAILED and "relayrl-sandbox:" in err_tail:
        line = next(x for x in err_tail.splitlines() if "relayrl-sandbox:" in x)
        return "sandbox_error", line.strip()
    if oom or "MemoryError" in err_tail or "Cannot allocate memory" in err_tail:
        return "memory_limit", f"memory limit: more than {limits.memory_mb} MiB requested"
    if sig == signal.SIGXCPU:
        return "cpu_limit", f"cpu limit: more than {limits.cpu_s:g} s of CPU time"
    if sig == signal.SIGKILL:
        return "killed", "killed by SIGKILL (CPU hard limit or out of memory)"
    if "BlockingIOError" in err_tail and "Resource temporarily unavailable" in err_tail:
        return "process_limit", f"process limit: more than {limits.max_processes} processes"
    if sig:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        return "killed", f"killed by signal {name}"
    if rc == 0:
        return "ok", None
    last = [x for x in err_tail.strip().splitlines() if x.strip()]
    detail = f": {last[-1].strip()[:200]}" if last else ""
    return "error", f"exit code {rc}{detail}"


def remove_orphaned_dirs(pid: int, tmp_root: str | None = None) -> int:
    """Remove the run directories a process ``pid`` left behind when it was killed in the
    middle of a run (the reward service calls this for the workers it replaces)."""
    root = Path(tmp_root or tempfile.gettempdir())
    n = 0
    for d in root.glob(f"relayrl-sbx-{int(pid)}-*"):
        with contextlib.suppress(OSError):
            _rmtree(d)
            n += 1
    for base in sos.cgroup_bases().values():
        for d in base.glob(f"relayrl-{int(pid)}-*"):
            with contextlib.suppress(OSError):
                for p in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(p), signal.SIGKILL)
                time.sleep(0.05)
                d.rmdir()
    return n


def run_python(
    code: str,
    *,
    limits: SandboxLimits | None = None,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: list[str] | None = None,
    isolation: Literal["auto", "bwrap", "namespace", "userns", "fallback"] = "auto",
) -> SandboxResult:
    """Run ``code`` once in a fresh ``Sandbox`` (see the module docstring)."""
    box = Sandbox(limits or SandboxLimits(), isolation=isolation)
    return box.run(code, stdin=stdin, files=files, argv=argv)

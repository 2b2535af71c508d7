"""Run untrusted Python programs (model-written code) in a fresh, contained subprocess.

Every run gets:

- a fresh process started in its own session (its own process group), with a wall-clock
  timeout after which the whole group is killed, then a sweep that kills anything left;
- resource limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size
  (``RLIMIT_FSIZE``: also caps stdout/stderr, which go to files), process count
  (``RLIMIT_NPROC``), open files, no core dumps;
- a private temporary directory as working directory, ``HOME`` and ``TMPDIR``, removed after
  the run; a scrubbed environment (only ``PATH``, locale and a few Python settings);
- no network.

How much the OS can do decides the isolation mode (``Sandbox.isolation``, probed once per
process, or forced with ``isolation=`` or the ``RELAYRL_SANDBOX_ISOLATION`` variable):

``namespace`` (root, with ``unshare``): new network namespace (no interface but a down
    loopback: every connection fails), new pid namespace (the program sees only its own
    processes; when its first process exits the kernel kills the rest), new mount namespace
    with a size-limited private tmpfs on ``/tmp`` (the work directory; whatever the program
    writes vanishes with it) and read-only root-owned tmpfs on the other world-writable
    directories, and a fresh unprivileged uid/gid per run: it cannot write anything it does
    not own, cannot signal or read other processes, and ``RLIMIT_NPROC`` counts only its own
    processes.
``userns`` (non-root, user namespaces allowed): a network namespace via a user namespace;
    the rest as ``fallback``.
``fallback``: rlimits, session, private directory and scrubbed environment as above, plus a
    Python audit-hook guard in the program: sockets other than AF_UNIX are refused, writes
    outside the work directory and reads of other processes' ``/proc`` are refused, signals
    may only go to its own processes; as root (where ``RLIMIT_NPROC`` does not apply) it also
    refuses new processes.

The program's stdout/stderr are captured up to ``SandboxLimits.max_output_bytes``.
``Sandbox.run`` never raises for anything the program does: the outcome is a
``SandboxResult`` with a ``status`` and a human-readable ``reason``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
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

__all__ = [
    "IsolationMode",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "detect_isolation",
    "remove_orphaned_dirs",
    "run_python",
]

IsolationMode = Literal["namespace", "userns", "fallback"]
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
_PR_SET_PDEATHSIG = 1
_UID_LOW = 200_000
_UID_HIGH = 2**31 - 2


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Args:
        cpu_s: CPU seconds per process (``RLIMIT_CPU``; SIGXCPU, then SIGKILL one second later).
        wall_s: wall-clock seconds for the whole run, start-up included; then the process
            group is killed.
        memory_mb: address space per process (``RLIMIT_AS``).
        file_size_mb: largest file a process may write, stdout and stderr included.
        disk_mb: size of the private tmpfs (``namespace`` mode).
        max_processes: processes the program may have at once (``RLIMIT_NPROC``).
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
    ``cpu_limit``, ``memory_limit``, ``output_limit`` (file-size limit hit on stdout/stderr),
    ``process_limit`` (could not fork), ``killed`` (by a signal), ``sandbox_error`` (the
    sandbox itself could not start the program). ``reason`` says it in words (None when ok).
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


def _uid_range() -> tuple[int, int]:
    """A range of uids that exist in this user namespace and belong to nobody in practice."""
    best = (_UID_LOW, _UID_HIGH)
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return best
    spans = []
    for line in lines:
        parts = line.split()
        if len(parts) == 3:
            start, count = int(parts[0]), int(parts[2])
            lo, hi = max(start, _UID_LOW), min(start + count - 1, _UID_HIGH)
            if hi - lo >= 1024:
                spans.append((lo, hi))
    if spans:
        return max(spans, key=lambda s: s[1] - s[0])
    return (60000, 65533)


def _namespace_cmd() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _userns_cmd() -> list[str]:
    return ["unshare", "--user", "--map-current-user", "--net"]


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


def detect_isolation() -> IsolationMode:
    """The strongest isolation mode this process can use (probed once, then cached).

    ``RELAYRL_SANDBOX_ISOLATION`` (``namespace`` / ``userns`` / ``fallback``) overrides it.
    """
    forced = os.environ.get("RELAYRL_SANDBOX_ISOLATION", "").strip()
    if forced:
        if forced not in ("namespace", "userns", "fallback"):
            raise ValueError(
                f"RELAYRL_SANDBOX_ISOLATION={forced!r}: expected namespace, userns or fallback"
            )
        return forced  # type: ignore[return-value]
    with _probe_lock:
        if "mode" in _probed:
            return _probed["mode"]
        mode: IsolationMode = "fallback"
        if sys.platform.startswith("linux"):
            if os.geteuid() == 0:
                lo, hi = _uid_range()
                uid = lo + secrets.randbelow(hi - lo)
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


# ---------------------------------------------------------------------------------------------
# process helpers


def _pdeathsig() -> None:  # runs in the child between fork and exec
    """Die with the parent: a killed reward worker takes its sandboxes with it."""
    with contextlib.suppress(Exception):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms
    _LIBC = None  # type: ignore[assignment]


_setpriv: list[list[str]] = []


def _pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL`` when util-linux's setpriv supports it (checked once)."""
    if not _setpriv:
        exe = shutil.which("setpriv")
        ok = False
        if exe is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                ok = (
                    subprocess.run(
                        [exe, "--pdeathsig", "KILL", "true"], capture_output=True, timeout=10
                    ).returncode
                    == 0
                )
        _setpriv.append([exe, "--pdeathsig", "KILL"] if ok and exe else [])
    return _setpriv[0]


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose owner is ``uid``."""
    out = []
    for pid in _pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
        except OSError:
            continue
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != b"Z":
            out.append(pid)
    return out


def processes_of_session(sid: int) -> list[int]:
    """Live processes in session ``sid`` (field 6 of ``/proc/PID/stat``)."""
    out = []
    for pid in _pids():
        fields = _stat_fields(pid)
        if fields is not None and len(fields) > 3 and fields[0] != b"Z" and int(fields[3]) == sid:
            out.append(pid)
    return out


def _sweep(find, deadline_s: float = 5.0) -> int:
    """SIGKILL whatever ``find()`` returns until it returns nothing; count the kills."""
    killed = 0
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        pids = [p for p in find() if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
    return killed


def _read_capped(path: Path, limit: int) -> tuple[str, int]:
    """First ``limit`` bytes of a file as text, and the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            data = f.read(limit)
    except OSError:
        return "", 0
    text = data.decode("utf-8", errors="replace")
    if size > limit:
        text += f"\n... [{size - limit} more bytes not kept]"
    return text, size


def _read_tail(path: Path, n: int = 4096) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _rmtree(path: Path) -> None:
    def onerror(func, p, exc_info):  # a program may have made its files read-only
        with contextlib.suppress(OSError):
            os.chmod(p, 0o700)
            os.chmod(os.path.dirname(p), 0o700)
            func(p)

    shutil.rmtree(path, onerror=onerror)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the sandbox


@dataclass
class Sandbox:
    """A reusable sandbox configuration; each ``run`` is a fresh process and directory.

    Args:
        limits: resource limits of each run.
        isolation: ``"auto"`` (probe), or force ``"namespace"``, ``"userns"``, ``"fallback"``.
        tmp_root: where the per-run host directories are created (default the system's).
        python: interpreter for the program (default: this one's base interpreter, so only
            the standard library is importable).
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    isolation: Literal["auto", "namespace", "userns", "fallback"] = "auto"
    tmp_root: str | None = None
    python: str | None = None

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "namespace", "userns", "fallback"):
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
    ) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh sandbox; never raises for program faults.

        Args:
            code: the program's source.
            stdin: its standard input (through a pipe).
            files: extra files to create in its work directory (relative path -> text).
            argv: its ``sys.argv[1:]``.
            channel: give the program a pipe on descriptor 3; what it writes there comes
                back as ``SandboxResult.channel`` (at most ``CHANNEL_BYTES``).
            capture_bytes: stdout bytes to keep (default ``limits.max_output_bytes``);
                ``SandboxResult.stdout_bytes`` is how many were written in all.
        """
        mode = self.mode
        limits = self.limits
        t0 = time.monotonic()
        if not isinstance(code, str):
            return SandboxResult(
                "sandbox_error", None, "", "", "program is not a string", 0.0, mode
            )
        files = dict(files or {})
        for name in files:
            norm = os.path.normpath(name)
            if norm.startswith("..") or os.path.isabs(norm) or norm == "main.py":
                return SandboxResult(
                    "sandbox_error", None, "", "", f"bad file name {name!r}", 0.0, mode
                )
        files["main.py"] = code
        hostdir = Path(tempfile.mkdtemp(prefix=f"relayrl-sbx-{os.getpid()}-", dir=self.tmp_root))
        uid: int | None = None
        proc: subprocess.Popen | None = None
        killed_by_us = False
        leftover = 0
        chan_r: int | None = None
        chan_w: int | None = None
        chan_data: list[bytes] = []
        reader: threading.Thread | None = None
        try:
            if channel:
                chan_r, chan_w = os.pipe()
            os.chmod(hostdir, 0o700 if mode == "namespace" else 0o711)
            exe, prefix = self._interpreter()
            root = os.geteuid() == 0
            if mode == "namespace":
                lo, hi = _uid_range()
                uid = lo + secrets.randbelow(hi - lo)
                cmd = [*_namespace_cmd()]
                guards: list[str] = []
            elif mode == "userns":
                cmd = [*_userns_cmd()]
                guards = ["--guard-fs", "--guard-kill"]
            else:
                cmd = []
                guards = ["--guard-net", "--guard-fs", "--guard-kill"]
            if mode != "namespace" and root:
                guards.append("--guard-proc")  # RLIMIT_NPROC does not bind root
            boot = {
                "private_tmp": mode == "namespace",
                "uid": uid,
                "files": files,
                "runner": _RUNNER.read_text(encoding="utf-8"),
                "runner_args": guards,
                "channel_fd": chan_w,
                "argv": ["main.py", *(argv or [])],
                "limits": asdict(limits),
                "python": exe,
                "prefix": prefix,
                "env": {
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "LANG": "C.UTF-8",
                    "LC_ALL": "C.UTF-8",
                    "PYTHONIOENCODING": "utf-8",
                    "PYTHONDONTWRITEBYTECODE": "1",
                    "PYTHONHASHSEED": "0",
                    "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1",
                },
            }
            boot_path = hostdir / "boot.json"
            boot_path.write_text(json.dumps(boot), encoding="utf-8")
            os.chmod(boot_path, 0o600)
            out_path, err_path = hostdir / "stdout", hostdir / "stderr"
            data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
            # die with the parent (a killed reward worker takes its sandboxes with it):
            # setpriv sets the parent-death signal before exec, no preexec_fn in threads
            guard_parent = _pdeathsig_prefix()
            with out_path.open("wb") as out_f, err_path.open("wb") as err_f:
                proc = subprocess.Popen(
                    [*guard_parent, *cmd, sys.executable, "-I", "-S", str(_BOOT), str(hostdir)],
                    stdin=subprocess.PIPE,
                    stdout=out_f,
                    stderr=err_f,
                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                    cwd=str(hostdir),
                    start_new_session=True,
                    close_fds=True,
                    preexec_fn=None if guard_parent or _LIBC is None else _pdeathsig,
                    pass_fds=() if chan_w is None else (chan_w,),
                )
            if chan_w is not None and chan_r is not None:
                os.close(chan_w)
                chan_w = None
                reader = threading.Thread(
                    target=_drain, args=(chan_r, chan_data), daemon=True, name="sandbox-chan"
                )
                reader.start()
            self._feed(proc, data)
            remaining = max(0.05, limits.wall_s - (time.monotonic() - t0))
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                killed_by_us = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # nothing may outlive the run: the process group, then the sandbox's uid/session
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if uid is not None:
                leftover = _sweep(lambda: processes_of_uid(uid))
            else:
                leftover = _sweep(lambda: processes_of_session(proc.pid))
            if reader is not None:
                reader.join(timeout=2.0)
            wall = time.monotonic() - t0
            keep = limits.max_output_bytes if capture_bytes is None else int(capture_bytes)
            stdout, out_size = _read_capped(out_path, keep)
            stderr, err_size = _read_capped(err_path, limits.max_output_bytes)
            status, reason = _classify(
                proc.returncode,
                killed_by_us,
                _read_tail(err_path),
                max(out_size, err_size),
                limits,
            )
            return SandboxResult(
                status,
                proc.returncode,
                stdout,
                stderr,
                reason,
                wall,
                mode,
                uid,
                leftover,
                b"".join(chan_data),
                out_size,
            )
        except Exception as exc:  # the sandbox itself failed: report, never raise
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return SandboxResult(
                "sandbox_error",
                None,
                "",
                "",
                f"{type(exc).__name__}: {exc}",
                time.monotonic() - t0,
                mode,
                uid,
                leftover,
            )
        finally:
            for fd in (chan_w, chan_r if reader is None or not reader.is_alive() else None):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            _rmtree(hostdir)

    @staticmethod
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


CHANNEL_BYTES = 16 << 20


def _drain(fd: int, out: list[bytes]) -> None:
    """Read a pipe to its end, keeping the first ``CHANNEL_BYTES``."""
    kept = 0
    with contextlib.suppress(OSError):
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            if kept < CHANNEL_BYTES:
                out.append(chunk[: CHANNEL_BYTES - kept])
                kept += len(out[-1])


def _classify(
    rc: int | None, killed_by_us: bool, err_tail: str, out_size: int, limits: SandboxLimits
) -> tuple[SandboxStatus, str | None]:
    fsize = limits.file_size_mb * 1024 * 1024
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if killed_by_us:
        return "timeout", f"timeout: still running after {limits.wall_s:g} s wall clock"
    if rc == BOOT_FAILED and "relayrl-sandbox:" in err_tail:
        line = next(x for x in err_tail.splitlines() if "relayrl-sandbox:" in x)
        return "sandbox_error", line.strip()
    if out_size >= fsize or "File too large" in err_tail:
        return "output_limit", f"output limit: more than {limits.file_size_mb} MiB written"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and "MemoryError" not in err_tail):
        if sig == signal.SIGXCPU:
            return "cpu_limit", f"cpu limit: more than {limits.cpu_s:g} s of CPU time"
        return "killed", "killed by SIGKILL (CPU hard limit or out of memory)"
    if "MemoryError" in err_tail or "Cannot allocate memory" in err_tail:
        return "memory_limit", f"memory limit: more than {limits.memory_mb} MiB requested"
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
    return n


def run_python(
    code: str,
    *,
    limits: SandboxLimits | None = None,
    stdin: str = "",
    files: dict[str, str] | None = None,
    argv: list[str] | None = None,
    isolation: Literal["auto", "namespace", "userns", "fallback"] = "auto",
) -> SandboxResult:
    """Run ``code`` once in a fresh ``Sandbox`` (see the module docstring)."""
    box = Sandbox(limits or SandboxLimits(), isolation=isolation)
    return box.run(code, stdin=stdin, files=files, argv=argv)

"""The run loop of one sandboxed program (``relayrl.reward.sandbox`` is the public API).

Types, the boot/runner paths, the pipe drains, the outcome classification and ``_Run``: the
state of one run (its process, uid, cgroups and pipes), whose ``cleanup`` leaves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from relayrl.reward.sandbox import os_limits as sos
from relayrl.reward.sandbox.os_limits import processes_of_session, processes_of_uid

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

_BOOT = Path(__file__).with_name("boot.py")
_RUNNER = Path(__file__).with_name("runner.py")
BOOT_FAILED = 197
CHANNEL_BYTES = 16 << 20


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
    program, or was killed from outside: not the program's doing). ``reason`` says it in
    words (None when ok). ``channel``: what the program wrote on descriptor 3
    (``channel=True``); ``stdout_bytes``: all stdout bytes it wrote.
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


def _namespace_cmd() -> list[str]:
    return ["unshare", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]


def _userns_cmd() -> list[str]:
    return ["unshare", "--user", "--map-current-user", "--net"]


def _read_tail(data: bytes, n: int = 4096) -> str:
    return data[-n:].decode("utf-8", errors="replace")


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
            mode,
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
    mode: IsolationMode = "fallback",
) -> tuple[SandboxStatus, str | None]:
    """The run's status and reason from its supervisor's exit status ``rc`` and what the run
    loop saw. In ``bwrap`` and ``namespace`` modes the process started here (bubblewrap,
    ``unshare``) is outside the program's pid namespace, and reports a program killed by a
    signal as exit code 128 + n; so ``rc == -SIGKILL`` there (the supervisor itself killed,
    not by this loop) is a kill from outside the sandbox (the host's OOM killer, an operator):
    ``sandbox_error``, not the program's doing. Elsewhere the supervisor is the program, and a
    SIGKILL is ``killed`` (the program may have sent it itself)."""
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
    if rc == -signal.SIGKILL and mode in ("bwrap", "namespace"):
        return "sandbox_error", "killed from outside the sandbox (SIGKILL of its supervisor)"
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

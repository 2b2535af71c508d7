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
``namespace`` (root with ``unshare``, no bwrap): new net/pid/IPC/UTS/mount namespaces, a
    private tmpfs ``/tmp``, a fresh uid per run; the host's world-readable files stay
    readable, limits are per process and there is no seccomp filter.
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
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from relayrl.reward.sandbox import os_limits as sos
from relayrl.reward.sandbox.os_limits import processes_of_session, processes_of_uid
from relayrl.reward.sandbox.run import (
    BOOT_FAILED,
    CHANNEL_BYTES,
    MODES,
    IsolationMode,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    _namespace_cmd,
    _Run,
    _userns_cmd,
)

__all__ = [
    "BOOT_FAILED",
    "CHANNEL_BYTES",
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

WEAKER = {
    "namespace": (
        "sandbox isolation 'namespace' (weaker than bwrap): the host's world-readable files "
        "stay readable, limits are per process, no seccomp; install bubblewrap"
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


def _reachable_by_others(path: str) -> bool:
    """Whether a uid with no rights of its own can execute ``path`` (every dir o+x)."""
    p = Path(path)
    try:
        if not os.stat(p).st_mode & 0o001:
            return False
        return all(os.stat(d).st_mode & 0o001 for d in p.parents)
    except OSError:
        return False


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

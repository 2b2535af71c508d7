"""Operating-system parts of the sandbox: uids, processes, cgroups, seccomp, bubblewrap.

Kept apart from ``sandbox`` (the public API and the run loop) so that each stays small. Only
the standard library is used.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

_UID_LOW = 200_000
_UID_HIGH = 2**31 - 2


def uid_range() -> tuple[int, int]:
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


def fresh_uid() -> int:
    lo, hi = uid_range()
    return lo + secrets.randbelow(hi - lo)


_setpriv: list[list[str]] = []


def pdeathsig_prefix() -> list[str]:
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


# ---------------------------------------------------------------------------------------------
# processes


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


def sweep(find: Callable[[], list[int]], deadline_s: float = 5.0) -> int:
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


# ---------------------------------------------------------------------------------------------
# cgroups: memory, pids and CPU over the whole sample (v1 or v2, where this process may write)

_CG_BASES: list[dict[str, Path]] = []


def _own_cgroups() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else ["unified"]:
                out[c] = path
    return out


def _writable_base(base: Path) -> bool:
    probe = base / f"relayrl-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def cgroup_bases() -> dict[str, Path]:
    """Controller -> the directory this process may create per-run cgroups in (probed once).

    v1: ``memory``, ``pids``, ``cpu``, ``cpuacct`` hierarchies; v2: ``unified`` where the
    memory, pids and cpu controllers are enabled for children. Empty where none is writable.
    """
    if _CG_BASES:
        return _CG_BASES[0]
    found: dict[str, Path] = {}
    own = _own_cgroups()
    root = Path("/sys/fs/cgroup")
    for ctrl in ("memory", "pids", "cpu", "cpuacct"):
        d = root / ctrl
        if ctrl in own and (d / "cgroup.procs").exists():
            base = d / own[ctrl].lstrip("/")
            if _writable_base(base):
                found[ctrl] = base
    if not found and (root / "cgroup.controllers").exists() and "unified" in own:
        base = root / own["unified"].lstrip("/")
        with contextlib.suppress(OSError):
            enabled = (base / "cgroup.subtree_control").read_text().split()
            if {"memory", "pids"} <= set(enabled) and _writable_base(base):
                found["unified"] = base
    _CG_BASES.append(found)
    return found


class RunCgroups:
    """The cgroups of one run: created with limits, joined by the boot, emptied and removed."""

    def __init__(self, name: str, memory_mb: int, max_pids: int) -> None:
        self.dirs: dict[str, Path] = {}
        for ctrl, base in cgroup_bases().items():
            d = base / name
            try:
                d.mkdir()
            except OSError:
                continue
            self.dirs[ctrl] = d
        mem = str(int(memory_mb) * 1024 * 1024)
        self._set("memory", "memory.limit_in_bytes", mem)
        self._set("memory", "memory.memsw.limit_in_bytes", mem)
        self._set("pids", "pids.max", str(int(max_pids)))
        self._set("cpu", "cpu.cfs_period_us", "100000")
        self._set("cpu", "cpu.cfs_quota_us", "100000")  # one core for the whole sample
        self._set("unified", "memory.max", mem)
        self._set("unified", "memory.swap.max", "0")
        self._set("unified", "pids.max", str(int(max_pids)))
        self._set("unified", "cpu.max", "100000 100000")

    def _set(self, ctrl: str, knob: str, value: str) -> None:
        d = self.dirs.get(ctrl)
        if d is not None:
            with contextlib.suppress(OSError):
                (d / knob).write_text(value)

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    @property
    def limits_memory(self) -> bool:
        return "memory" in self.dirs or "unified" in self.dirs

    def cpu_seconds(self) -> float | None:
        for ctrl, knob, scale in (("cpuacct", "cpuacct.usage", 1e-9), ("unified", "", 1e-6)):
            d = self.dirs.get(ctrl)
            if d is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                if knob:
                    return int((d / knob).read_text()) * scale
                for line in (d / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec"):
                        return int(line.split()[1]) * scale
        return None

    def oom_killed(self) -> bool:
        for ctrl, knob, key in (
            ("memory", "memory.oom_control", "oom_kill"),
            ("unified", "memory.events", "oom_kill"),
        ):
            d = self.dirs.get(ctrl)
            if d is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                for line in (d / knob).read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == key and int(parts[1]) > 0:
                        return True
            with contextlib.suppress(OSError, ValueError):
                if ctrl == "memory" and int((d / "memory.failcnt").read_text()) > 0:
                    return True
        return False

    def procs(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError, ValueError):
                out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        return sorted(out)

    def remove(self) -> int:
        """Kill whatever is still inside, then remove the directories; count the kills."""
        killed = sweep(self.procs)
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        return killed


# ---------------------------------------------------------------------------------------------
# seccomp: a classic-BPF filter handed to bubblewrap (x86_64 only; elsewhere none)

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_RET_ALLOW, _RET_KILL, _RET_EPERM = 0x7FFF0000, 0x80000000, 0x00050000 | 1
# refused with EPERM: keyrings, ptrace and other processes' memory, mounts and namespaces,
# kernel interfaces a test program never needs (bpf, perf, io_uring, userfaultfd, modules)
DENIED_SYSCALLS_X86_64 = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "unshare": 272,
    "setns": 308,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "acct": 163,
    "quotactl": 179,
    "lookup_dcookie": 212,
}


def seccomp_filter() -> bytes | None:
    """The filter program (``struct sock_filter`` array), or None on other architectures."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None

    def ins(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    nrs = sorted(DENIED_SYSCALLS_X86_64.values())
    prog = [ins(ld, 0, 0, 4), ins(jeq, 1, 0, _AUDIT_ARCH_X86_64), ins(ret, 0, 0, _RET_KILL)]
    prog.append(ins(ld, 0, 0, 0))
    # the EPERM return sits after len(nrs) compares and the ALLOW return
    n = len(nrs)
    prog.append(ins(jge, n + 1, 0, _X32_BIT))
    for i, nr in enumerate(nrs):
        prog.append(ins(jeq, n - i, 0, nr))
    prog.append(ins(ret, 0, 0, _RET_ALLOW))
    prog.append(ins(ret, 0, 0, _RET_EPERM))
    return b"".join(prog)


# ---------------------------------------------------------------------------------------------
# bubblewrap


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def bwrap_argv(
    *,
    uid: int,
    prefix: str | None,
    prefix_src: str | None,
    inbox: str,
    disk_mb: int,
    env: dict[str, str],
    seccomp_fd: int | None,
) -> list[str]:
    """bwrap's options: every namespace (user, pid, net, ipc, uts, cgroup), no nested user
    namespaces, a root of read-only system directories, the interpreter and the run's inputs,
    a private size-limited ``/tmp``, fresh ``/proc`` and ``/dev``, the given environment only.
    """
    exe = bwrap_path() or "bwrap"
    args = [exe, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net"]
    args += ["--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent"]
    args += ["--new-session", "--uid", str(uid), "--gid", str(uid), "--hostname", "sandbox"]
    args += ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf"):
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    if prefix is not None and prefix_src is not None:
        args += ["--ro-bind", prefix_src, prefix]
    args += ["--ro-bind", inbox, "/.relayrl"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(int(disk_mb) * 1024 * 1024), "--tmpfs", "/tmp"]
    args += ["--remount-ro", "/"]
    args += ["--chdir", "/tmp", "--clearenv"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args

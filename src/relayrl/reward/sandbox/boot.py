"""Sandbox boot: run as ``python -I -S boot.py HOSTDIR`` by ``relayrl.reward.sandbox``.

``bwrap`` mode: it runs on the host (trusted, as the caller), and in order it joins the
run's cgroups (so that every process of the sample is counted), makes the interpreter's
prefix reachable for the sandbox uid (as root: a read-only bind in a private mount namespace
under the run directory), drops to the sandbox uid with no groups, lowers the resource
limits, puts the seccomp filter in a memfd and ``execve``-s bubblewrap on the runner.

Other modes: it is the first process inside the sandbox (pid 1 of a fresh pid namespace in
``namespace`` mode, where it still runs as root). In order it:

1. reads ``HOSTDIR/boot.json`` (everything it needs, before any mount hides HOSTDIR);
2. ``namespace`` mode: mounts a size-limited private tmpfs on ``/tmp`` (the program's work
   directory lives there, and vanishes with the namespace), root-owned read-only tmpfs on the
   other world-writable directories, and a read-only bind of the Python prefix so that an
   unprivileged uid can run the interpreter wherever it is installed;
3. writes the program's files and the runner script;
4. ``namespace`` mode: forks, and stays as the namespace's init (reaping orphans) until
   its child exits; the child goes on:
5. drops to the sandbox uid/gid with no supplementary groups (when given);
6. lowers the resource limits (CPU, address space, file size, processes, open files, core);
7. ``execve``-s the interpreter on the runner with a scrubbed environment.

Only the standard library is used (``-S``: no site-packages). Any failure exits with status
``BOOT_FAILED`` after one line on stderr starting with ``relayrl-sandbox:``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

BOOT_FAILED = 197
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
CLONE_NEWNS = 0x00020000


def _mount(
    libc: ctypes.CDLL,
    src: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _private_mount_namespace(libc: ctypes.CDLL) -> None:
    """A mount namespace of this process alone, with nothing propagating back: every mount
    the boot makes happens after this succeeded (a mount must never reach the host)."""
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)


def _setup_namespace(cfg: dict) -> tuple[str, str, str, dict[str, str]]:
    """Private mounts; returns (work dir, system dir, interpreter path, extra env)."""
    if os.getpid() != 1:  # never mount anything in the caller's namespaces
        raise RuntimeError("namespace mode: not pid 1 of a fresh namespace, refusing to mount")
    libc = ctypes.CDLL(None, use_errno=True)
    _private_mount_namespace(libc)
    disk = int(cfg["limits"]["disk_mb"])
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk}m,mode=1777")
    for d in ("/var/tmp", "/dev/shm", "/run/lock"):
        if os.path.isdir(d):
            try:
                _mount(
                    libc, "tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755"
                )
            except OSError:
                pass  # best effort: the sandbox uid cannot write a root-owned dir anyway
    sysdir = "/tmp/.relayrl"
    os.mkdir(sysdir, 0o755)
    prefix = cfg["prefix"]
    exe = os.path.realpath(cfg["python"])
    rel = os.path.relpath(exe, prefix)
    env: dict[str, str] = {}
    if rel.startswith(".."):
        python = exe  # interpreter outside its prefix: use it as it is
    else:
        pydir = os.path.join(sysdir, "python")
        os.mkdir(pydir, 0o755)
        _mount(libc, prefix, pydir, None, MS_BIND | MS_REC)
        _mount(libc, None, pydir, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
        python = os.path.join(pydir, rel)
        # an interpreter built with an absolute RUNPATH into an unreadable prefix
        env["LD_LIBRARY_PATH"] = os.path.join(pydir, "lib")
    return "/tmp/work", sysdir, python, env


def _count_processes(uid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _set_limits(limits: dict, uid_dropped: bool) -> None:
    cpu = max(1, int(-(-float(limits["cpu_s"]) // 1)))
    mem = int(limits["memory_mb"]) * 1024 * 1024
    fsize = int(limits["file_size_mb"]) * 1024 * 1024
    nproc = int(limits["max_processes"])
    if not uid_dropped:
        # RLIMIT_NPROC counts every process of the real uid: leave room for the existing ones
        nproc += _count_processes(os.getuid())
    nofile = int(limits["max_open_files"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _write(path: str, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _channel(cfg: dict) -> None:
    chan = cfg.get("channel_fd")
    if chan is not None and chan != 3:  # the result channel is descriptor 3 for the program
        os.dup2(chan, 3, inheritable=True)
        os.close(chan)


def _join_cgroups(cfg: dict) -> None:
    for procs in cfg.get("cgroup_procs", []):
        with open(procs, "w") as f:
            f.write(str(os.getpid()))


def _boot_bwrap(cfg: dict) -> None:
    _join_cgroups(cfg)
    stage = cfg.get("stage")
    if stage:  # as root: put the inputs where the sandbox uid can reach them, read-only
        libc = ctypes.CDLL(None, use_errno=True)
        _private_mount_namespace(libc)
        fds = {dst: os.open(src, os.O_PATH | os.O_DIRECTORY) for src, dst in stage.items()}
        _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
        for dst, fd in fds.items():
            os.mkdir(dst, 0o755)
            _mount(libc, f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
            _mount(libc, None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)
            os.close(fd)
    _channel(cfg)
    argv = list(cfg["bwrap"])
    seccomp = bytes.fromhex(cfg.get("seccomp") or "")
    if seccomp:
        fd = os.memfd_create("relayrl-seccomp", 0)
        os.write(fd, seccomp)
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
        argv += ["--seccomp", str(fd)]
    argv += ["--", *cfg["command"]]
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # room for bwrap's own two processes; the cgroup's pids.max holds over the whole sample
    limits = dict(cfg["limits"], max_processes=int(cfg["limits"]["max_processes"]) + 2)
    _set_limits(limits, uid is not None)
    os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin"})


def main() -> None:
    hostdir = sys.argv[1]
    with open(os.path.join(hostdir, "boot.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("mode") == "bwrap":
        _boot_bwrap(cfg)
        return
    env = dict(cfg["env"])
    if cfg["private_tmp"]:
        work, sysdir, python, extra = _setup_namespace(cfg)
        env.update(extra)
    else:
        work, sysdir, python = (
            os.path.join(hostdir, "work"),
            os.path.join(hostdir, "sys"),
            cfg["python"],
        )
        os.mkdir(sysdir, 0o755)
    runner = os.path.join(sysdir, "runner.py")
    _write(runner, cfg["runner"], 0o644)
    os.mkdir(work, 0o700)
    for name, text in cfg["files"].items():
        path = os.path.join(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, text, 0o644)
    uid = cfg["uid"]
    if uid is not None:
        for dirpath, dirnames, filenames in os.walk(work):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                os.chown(name, uid, uid)
    env["HOME"] = env["TMPDIR"] = work
    _channel(cfg)
    argv = [python, "-I", "-B", runner, *cfg["runner_args"], work, "--", *cfg["argv"]]
    if cfg["private_tmp"]:
        # We are pid 1 of the pid namespace. The kernel does not deliver signals without a
        # handler to pid 1 (RLIMIT_CPU's SIGXCPU would be lost), so the program runs as our
        # child; we reap orphans until it exits, then exit, and the kernel kills the rest.
        child = os.fork()
        if child == 0:
            _exec_program(cfg, uid, work, python, argv, env)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                os._exit(128 - code if code < 0 else code)
    _exec_program(cfg, uid, work, python, argv, env)


def _exec_program(
    cfg: dict, uid: int | None, work: str, python: str, argv: list[str], env: dict[str, str]
) -> None:
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        _set_limits(cfg["limits"], uid is not None)
        os.chdir(work)
        os.execve(python, argv, env)
    except BaseException as exc:
        sys.stderr.write(f"relayrl-sandbox: boot failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(BOOT_FAILED)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # report and exit: never run the program half set up
        sys.stderr.write(f"relayrl-sandbox: boot failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(BOOT_FAILED)

"""Sandbox runner: ``python -I -B runner.py [--guard-...] [--copy SRC] WORKDIR -- main.py ...``.

``--copy SRC``: copy the (read-only) inputs into WORKDIR and work there (``bwrap`` mode).

Copied into the sandbox by the boot script and run as the sandboxed user. It optionally
installs an audit hook (PEP 578; hooks cannot be removed once added) and then executes
``main.py`` as ``__main__``.

The guard is the fallback where the OS isolation is missing (no namespaces, or no separate
uid): it is defence in depth for Python programs, not a security boundary of its own.

- ``--guard-net``: sockets other than AF_UNIX are refused (``ConnectionRefusedError``);
- ``--guard-fs``: writes, deletions, renames and permission changes outside WORKDIR, and
  reads of other processes' ``/proc`` entries, are refused (``PermissionError``);
- ``--guard-kill``: signals may only go to this process, its own process group, or its
  descendants;
- ``--guard-proc``: no new processes (fork, exec, spawn, subprocess) and no ctypes; used when
  the process-count limit cannot be enforced (running as root without a separate uid).
"""

from __future__ import annotations

import os
import sys
import threading

_NET_EVENTS = {
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
}
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (1,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.mkfifo": (0,),
    "os.mknod": (0,),
    "os.chflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.move": (1,),
}
_PROC_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.exec",
    "os.system",
    "os.spawn",
    "subprocess.Popen",
    "pty.spawn",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "os.startfile",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _make_hook(work: str, net: bool, fs: bool, kill: bool, proc: bool):
    busy = threading.local()
    me = os.getpid()
    realpath = os.path.realpath

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return True
        real = realpath(path)
        return real == work or real.startswith(work + os.sep) or real == "/dev/null"

    def other_proc(path: object) -> bool:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False
        real = realpath(path)
        parts = real.split(os.sep)
        return (
            len(parts) > 2
            and parts[1] == "proc"
            and parts[2].isdigit()
            and int(parts[2]) != os.getpid()
        )

    def descendant(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 4096:
            if pid == me:
                return True
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
                pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                return False
            seen += 1
        return False

    def hook(event: str, args: tuple) -> None:
        if getattr(busy, "on", False):
            return
        busy.on = True
        try:
            if net and event in _NET_EVENTS:
                if event == "socket.__new__" and len(args) > 1 and args[1] == 1:  # AF_UNIX
                    return
                if event in ("socket.connect", "socket.bind", "socket.sendto"):
                    addr = args[1] if len(args) > 1 else None
                    if isinstance(addr, (str, bytes)):
                        return  # a unix socket path
                raise ConnectionRefusedError(111, "network access is disabled in the sandbox")
            if fs and event == "open":
                path = args[0]
                mode = args[1] if len(args) > 1 else None
                flags = args[2] if len(args) > 2 else 0
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & _WRITE_FLAGS
                )
                if writing and not inside(path):
                    raise PermissionError(13, f"sandbox: writing outside {work}", str(path))
                if other_proc(path):
                    raise PermissionError(13, "sandbox: other processes are not visible")
            elif fs and event in _PATH_EVENTS:
                for i in _PATH_EVENTS[event]:
                    if i < len(args) and not inside(args[i]):
                        raise PermissionError(13, f"sandbox: {event} outside {work}")
            elif fs and event == "os.listdir" and args and other_proc(args[0]):
                raise PermissionError(13, "sandbox: other processes are not visible")
            if kill and event in ("os.kill", "os.killpg"):
                pid = int(args[0])
                if event == "os.killpg":
                    if pid != os.getpgid(0):
                        raise PermissionError(1, "sandbox: may not signal that process group")
                elif not (pid == 0 or pid == os.getpid() or (pid > 0 and descendant(pid))):
                    raise PermissionError(1, "sandbox: may only signal its own processes")
            if proc and (
                event in _PROC_EVENTS
                or (event == "import" and args and args[0] in ("_posixsubprocess", "_ctypes"))
            ):
                raise PermissionError(1, f"sandbox: {event} is not allowed")
        finally:
            busy.on = False

    return hook


def main() -> None:
    args = sys.argv[1:]
    flags = set()
    while args and args[0].startswith("--guard-"):
        flags.add(args.pop(0)[len("--guard-") :])
    copy_from = None
    if args and args[0] == "--copy":
        args.pop(0)
        copy_from = args.pop(0)
    work = os.path.realpath(args.pop(0))
    if args and args[0] == "--":
        args.pop(0)
    if copy_from is not None:  # bwrap mode: the inputs are read-only, the work dir is ours
        import shutil

        shutil.copytree(copy_from, work)
        os.chmod(work, 0o700)
        os.chdir(work)
    main_path = os.path.abspath(args[0])
    with open(main_path, "rb") as f:
        source = f.read()
    code = compile(source, main_path, "exec")
    if flags:
        sys.addaudithook(
            _make_hook(work, "net" in flags, "fs" in flags, "kill" in flags, "proc" in flags)
        )
    sys.argv = args
    sys.path.insert(0, os.path.dirname(main_path))
    import types

    module = types.ModuleType("__main__")
    module.__file__ = main_path
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()

"""A directory replaced in one step, and what a process killed mid-way left completed.

The one code path of every whole-directory save: ``relayrl sft``'s and ``relayrl rm``'s output
model (``save_model_atomic``), ``relayrl models fetch``, the tinker service's checkpoints
(``relayrl.tinker.checkpoints``). Beside ``out`` while a save runs (``<prefix><name>_<pid>``):

- ``.tmp_<name>_<pid>``: the new directory being written (its files fsynced before the swap);
- ``.old_<name>_<pid>``: the old directory, renamed away just before the new one is renamed in.

A reader sees the old directory or the new one, except in the instant between the two renames;
a process killed there leaves no ``out`` and both siblings: :func:`finish_interrupted_save`
(the next writer, before it claims ``out``) renames the new one into place.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX, OLD_PREFIX = ".tmp_", ".old_"
"""The siblings of ``out``: the new directory being written, the old one being replaced."""


def _fsync_tree(d: Path) -> None:
    """fsync every file under ``d``, then ``d`` itself (its entries)."""
    for f in sorted(d.rglob("*")):
        if f.is_file() and not f.is_symlink():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(d)


def fsync_dir(d: Path) -> None:
    """fsync directory ``d`` itself: the renames inside it made durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir_atomic(
    out_dir: str | Path, fill: Callable[[Path], None], keep: tuple[str, ...] = ()
) -> Path:
    """``fill(tmp)`` writes the new directory's files into ``tmp`` (a sibling of ``out_dir``);
    they are fsynced, then the new directory is swapped in for ``out_dir``. ``keep``: entries of
    the old directory carried into the new one, not removed with it; they move last, out of the
    old directory into the new one. A process killed in the swap leaves what
    :func:`finish_interrupted_save` completes; a failed ``fill`` removes ``tmp`` and leaves
    ``out_dir`` as it was."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}_{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        fill(tmp)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists():
        os.replace(tmp, out)
    else:
        old = out.parent / f"{OLD_PREFIX}{out.name}_{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        _carry(old, out, keep)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)
    return out


def _carry(old: Path, out: Path, keep: tuple[str, ...]) -> None:
    for name in keep:
        if (old / name).exists() and not (out / name).exists():
            os.rename(old / name, out / name)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finish_interrupted_save(out_dir: str | Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Complete what a ``write_dir_atomic`` killed mid-way left beside ``out_dir`` (only its
    dead writers' leftovers: ``<prefix><name>_<pid>`` of no live process); return what was
    done, in words. Killed after the old directory was renamed away: the new one (complete by
    then) becomes ``out_dir``; then, or when killed after that, the old one's ``keep`` entries
    move into ``out_dir`` and the rest of it is removed. A temp dir with no old directory
    beside it was killed while being written: removed."""
    out = Path(out_dir)
    done: list[str] = []
    if not out.parent.is_dir():
        return done

    def dead(prefix: str) -> dict[int, Path]:
        found = {}
        for p in out.parent.glob(f"{prefix}{out.name}_*"):
            pid = p.name[len(prefix) + len(out.name) + 1 :]
            if pid.isdigit() and not pid_alive(int(pid)):
                found[int(pid)] = p
        return found

    tmps = dead(TMP_PREFIX)
    for pid, old in sorted(dead(OLD_PREFIX).items()):
        if not out.exists() and pid in tmps:
            os.replace(tmps.pop(pid), out)
            done.append(f"completed the interrupted save of {out}")
        elif not out.exists():
            os.replace(old, out)
            done.append(f"restored {out} from {old.name}")
            continue
        carried = [n for n in keep if (old / n).exists() and not (out / n).exists()]
        _carry(old, out, keep)
        done += [f"recovered {out / n} from an interrupted save" for n in carried]
        shutil.rmtree(old, ignore_errors=True)
    for tmp in tmps.values():
        shutil.rmtree(tmp, ignore_errors=True)
    return done


def finish_interrupted_saves(parent: str | Path) -> list[str]:
    """:func:`finish_interrupted_save` of every directory under ``parent`` a dead writer left
    siblings of (the tinker service's checkpoints of one kind, on start)."""
    root = Path(parent)
    if not root.is_dir():
        return []
    names = set()
    for p in root.iterdir():
        for prefix in (TMP_PREFIX, OLD_PREFIX):
            name, _, pid = p.name[len(prefix) :].rpartition("_")
            if p.name.startswith(prefix) and name and pid.isdigit():
                names.add(name)
    return [line for name in sorted(names) for line in finish_interrupted_save(root / name)]

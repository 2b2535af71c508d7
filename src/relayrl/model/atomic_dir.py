"""A directory replaced in one step, and what a process killed mid-way left completed.

The one code path of every whole-directory save: ``relayrl sft``'s and ``relayrl rm``'s output
model (``save_model_atomic``), ``relayrl models fetch``, the tinker service's checkpoints
(``relayrl.tinker.checkpoints``). Beside ``out`` while a save runs (``<prefix><name>_<pid>``):

- ``.tmp_<name>_<pid>``: the new directory being written (its files fsynced before the swap);
- ``.old_<name>_<pid>``: the old directory, renamed away just before the new one is renamed in.

A reader sees the old directory or the new one, except in the instant between the two renames;
a process killed there leaves no ``out`` and both siblings: :func:`finish_interrupted_save`
(the next writer, before it claims ``out``) renames the new one into place.

Durability (a power loss, not only a killed process): a rename is on disk only once the
directory holding it is fsynced, and a renamed file's contents only once the file is. The
helpers of ``relayrl.durable`` (one copy; import them from there) are the one way every save makes
them so (this module's saves, the training checkpoints, their ``latest`` marker and their
pruning in ``relayrl.controller.checkpoint``, a run's ``config.yaml`` in
``relayrl.controller.run_dir``, ``relayrl.data.jsonl.write_jsonl``, ``metrics.jsonl``'s
rewrite on a resume in ``relayrl.telemetry.metrics``): the new files and directories are
fsynced before the rename (:func:`fsync_tree`, :func:`write_file_durable`), the parent
directory after it (:func:`replace_durable`), a directory created on the way in its parent
(:func:`mkdir_durable`), and a directory whose entry was renamed away or removed
(:func:`fsync_dir`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from relayrl.durable import fsync_dir, fsync_tree, mkdir_durable, replace_durable

__all__ = [
    "OLD_PREFIX",
    "TMP_PREFIX",
    "finish_interrupted_save",
    "finish_interrupted_saves",
    "pid_alive",
    "write_dir_atomic",
]

TMP_PREFIX, OLD_PREFIX = ".tmp_", ".old_"
"""The siblings of ``out``: the new directory being written, the old one being replaced."""


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
    mkdir_durable(out.parent)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}_{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        fill(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not out.exists():
        replace_durable(tmp, out)
        return out
    old = out.parent / f"{OLD_PREFIX}{out.name}_{os.getpid()}"
    os.replace(out, old)
    replace_durable(tmp, out)  # both renames on disk before anything moves out of ``old``
    if _carry(old, out, keep):
        fsync_dir(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def _carry(old: Path, out: Path, keep: tuple[str, ...]) -> list[str]:
    """Move ``keep``'s entries of ``old`` missing from ``out`` into it; return their names."""
    moved = [n for n in keep if (old / n).exists() and not (out / n).exists()]
    for name in moved:
        os.rename(old / name, out / name)
    return moved


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
            replace_durable(tmps.pop(pid), out)
            done.append(f"completed the interrupted save of {out}")
        elif not out.exists():
            replace_durable(old, out)
            done.append(f"restored {out} from {old.name}")
            continue
        carried = _carry(old, out, keep)
        if carried:
            fsync_dir(out)
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

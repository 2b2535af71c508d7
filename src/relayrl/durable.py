"""Files on disk across a power loss, and append-only logs read back after one (a base module).

A rename, a create or a delete is on disk only once the directory holding it is fsynced, and a
file's contents only once the file is. These helpers are the one way relayrl makes them so:
the new file or directory fsynced before its rename (:func:`fsync_file`, :func:`fsync_tree`,
:func:`write_file_durable`), the parent directory after it (:func:`replace_durable`), a
directory created on the way in its parent (:func:`mkdir_durable`), a directory whose entry was
renamed away or removed (:func:`fsync_dir`). ``relayrl.model.atomic_dir`` re-exports them for
its whole-directory saves; the telemetry leaf uses them directly.

An append-only JSONL log (``metrics.jsonl``, ``trajectories.jsonl``) written line by line may
end in a torn line after a kill or a power loss mid-append: bytes after the last newline.
:func:`read_jsonl_log` skips such a final line when it does not parse (with a warning naming
the file and line); a line that does not parse anywhere else is an error naming it.
:func:`end_at_last_line` makes the file end with a complete line before anything is appended
again, so a torn line never sits in the middle. :func:`split_jsonl_log` moves the records a
resume trains again out of such a log (into a file beside it), streaming it line by line.

A base module: only the standard library (``os``, ``pathlib``, ``json``, ``warnings``,
``collections.abc``), no other relayrl module; every layer, the leaves and the config
included, may import it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "end_at_last_line",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "mkdir_durable",
    "read_jsonl_log",
    "replace_durable",
    "split_jsonl_log",
    "write_file_durable",
]


def fsync_file(f: Path) -> None:
    """fsync the contents of file ``f``."""
    with open(f, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(d: Path) -> None:
    """fsync directory ``d`` itself: its entries (the files created, renamed or removed in it)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(d: Path) -> None:
    """fsync every file under ``d``, then every directory under it, deepest first, then ``d``
    itself: all of ``d`` on disk before it is renamed into place (symlinks not followed)."""
    entries = sorted(d.rglob("*"))
    for f in entries:
        if f.is_file() and not f.is_symlink():
            fsync_file(f)
    for sub in sorted(entries, key=lambda p: len(p.parts), reverse=True):
        if sub.is_dir() and not sub.is_symlink():
            fsync_dir(sub)
    fsync_dir(d)


def replace_durable(src: Path, dst: Path) -> None:
    """``os.replace(src, dst)``, then the directory of ``dst`` fsynced (and that of ``src``
    when it is another): the rename on disk when this returns. ``src`` itself is fsynced by
    the caller before (:func:`fsync_tree`, :func:`fsync_file`)."""
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def write_file_durable(path: Path, text: str, tmp: Path | None = None) -> None:
    """Replace file ``path`` with ``text`` (UTF-8) in one step, durably: written into ``tmp``
    (default: a sibling ``.<name>_<pid>``), fsynced, renamed over ``path``, the directory
    fsynced. A failure removes ``tmp`` and leaves ``path`` as it was."""
    tmp = tmp if tmp is not None else path.parent / f".{path.name}_{os.getpid()}"
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync_file(tmp)
        replace_durable(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def mkdir_durable(d: Path) -> None:
    """``d.mkdir(parents=True, exist_ok=True)``; each directory it creates is fsynced in its
    parent (a first save into a new directory is not lost with the directory's entry)."""
    missing = []
    above = d
    while not above.exists() and above != above.parent:
        missing.append(above)
        above = above.parent
    d.mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        fsync_dir(made.parent)


def read_jsonl_log(path: Path) -> list[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of the JSONL log ``path`` (numbered
    from 1). A final line that does not parse and has no newline after it (an append cut
    short) is skipped with a ``UserWarning`` naming ``path`` and the line; any other line that
    does not parse raises ``ValueError`` naming them."""
    lines = path.read_text(encoding="utf-8").split("\n")  # the last: after the last newline
    out: list[tuple[int, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((i + 1, json.loads(line)))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                warnings.warn(
                    f"{path}: line {i + 1} is torn (an append cut short by a kill or a power "
                    "loss): skipped",
                    stacklevel=2,
                )
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {e.msg}") from e
    return out


def end_at_last_line(path: Path) -> str | None:
    """Make the JSONL log ``path`` end with a complete line before anything is appended to it.
    Bytes after its last newline that do not parse (a torn append) are cut off; ones that
    parse (a whole record whose newline was lost) get their newline. The file is fsynced
    then. Returns what was done, in words (None: nothing to do, or no file)."""
    if not path.is_file():
        return None
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        chunk = 1 << 16
        while end > 0:  # the offset just past the last newline (0 when there is none)
            start = max(0, end - chunk)
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
        if end == size:
            return None
        f.seek(end)
        tail = f.read()
        f.seek(0)
        ended = sum(f.read(min(chunk, end - i)).count(b"\n") for i in range(0, end, chunk))
        lineno = f"line {ended + 1}"
        try:
            json.loads(tail)
        except (json.JSONDecodeError, UnicodeDecodeError):
            f.truncate(end)
            done = f"cut the torn {lineno} ({size - end} bytes) off {path}"
        else:
            f.seek(size)
            f.write(b"\n")
            done = f"ended the unfinished {lineno} of {path} with its newline"
        f.flush()
        os.fsync(f.fileno())
    return done


def split_jsonl_log(path: Path, keep: Callable[[Any], bool], aside: Path) -> tuple[int, int]:
    """Move the records of the JSONL log ``path`` that ``keep`` rejects into the new file
    ``aside``; the others stay in ``path``, in their order, byte for byte (a final record
    without its newline gets one). Returns ``(kept, set aside)``.

    Streamed line by line (the log may be larger than memory) into temporary files beside each
    (``.<name>.tmp``). ``path`` is left untouched (the temporary files removed) unless a record
    is set aside or its last line is torn; else ``aside``'s file is fsynced and renamed into
    place, then ``path``'s, each rename followed by the fsync of the directory
    (:func:`replace_durable`): after a power loss a record set aside is in ``aside``, in
    ``path`` or in both, never in neither. Lines read as :func:`read_jsonl_log` does: a final
    line that does not parse and has no newline after it (a torn append) is dropped with a
    ``UserWarning`` naming ``path`` and the line, another line that does not parse raises
    ``ValueError`` naming them (nothing is changed then); blank lines stay. ``aside`` must not
    exist (the caller picks a free name)."""
    if aside.exists():
        raise FileExistsError(f"{aside} exists: the records set aside would overwrite it")
    tmp_keep = path.with_name(f".{path.name}.tmp")
    tmp_aside = aside.with_name(f".{aside.name}.tmp")
    kept = moved = 0
    changed = False
    try:
        with open(path, "rb") as src, open(tmp_keep, "wb") as out, open(tmp_aside, "wb") as off:
            for n, line in enumerate(src, start=1):
                ended = line.endswith(b"\n")
                if not line.strip():
                    out.write(line)
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError
                    if not ended:
                        warnings.warn(
                            f"{path}: line {n} is torn (an append cut short by a kill or a power "
                            "loss): dropped",
                            stacklevel=2,
                        )
                        changed = True
                        break
                    raise ValueError(
                        f"{path}: line {n} is not valid JSON: {getattr(e, 'msg', e)}"
                    ) from e
                record = line if ended else line + b"\n"
                changed = changed or not ended
                if keep(row):
                    out.write(record)
                    kept += 1
                else:
                    off.write(record)
                    moved += 1
        if moved or changed:
            if moved:
                fsync_file(tmp_aside)
                replace_durable(tmp_aside, aside)
            fsync_file(tmp_keep)
            replace_durable(tmp_keep, path)
    finally:
        tmp_keep.unlink(missing_ok=True)
        tmp_aside.unlink(missing_ok=True)
    return kept, moved

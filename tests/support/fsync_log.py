"""Record the fsyncs and renames of a save, in order, to check what is durable when.

:func:`record` patches ``os.fsync``, ``os.replace`` and ``os.rename`` (still doing the real
thing) and returns the log it fills: ``("fsync", path)`` (the path the descriptor was opened
on, from ``/proc/self/fd``), ``("replace", src, dst)``, ``("rename", src, dst)``; every path
resolved. :func:`at` is the index of the first entry that matches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

Event = tuple[str, ...]


def record(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    log: list[Event] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def moved(kind: str, real: Any) -> Any:
        def move(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            log.append((kind, str(Path(src).resolve()), str(Path(dst).resolve())))
            return real(src, dst, *a, **k)

        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", moved("replace", real_replace))
    monkeypatch.setattr(os, "rename", moved("rename", real_rename))
    return log


def at(log: list[Event], *event: Any) -> int:
    """The index of the first ``event`` in ``log`` (its paths given as ``Path`` or str)."""
    want = tuple(str(Path(e).resolve()) if isinstance(e, Path) else e for e in event)
    for i, e in enumerate(log):
        if e == want:
            return i
    raise AssertionError(f"{want} not in {log}")


def fsynced(log: list[Event]) -> list[str]:
    """The paths fsynced, in order."""
    return [e[1] for e in log if e[0] == "fsync"]

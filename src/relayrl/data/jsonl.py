"""JSONL files: reading SFT rows and any JSON objects with ``file:line`` errors, writing rows.

Prompt rows are read by the prompt pipeline's one loader (``relayrl.data.prompts.read``), which
takes JSONL, Parquet and saved datasets alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from relayrl.data.records import SFTRecord
from relayrl.durable import fsync_file, mkdir_durable, replace_durable

__all__ = ["DataError", "iter_jsonl_objects", "load_sft_jsonl", "write_jsonl"]

T = TypeVar("T")


class DataError(ValueError):
    """A dataset file is missing or holds a malformed row; the message names file:line."""


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def iter_jsonl_objects(path: str | Path, require_object: bool = True) -> Iterator[tuple[int, Any]]:
    """Yield (line number, JSON value) for each non-blank line; raise DataError on bad ones
    (a value that is not an object too, unless ``require_object`` is False: the caller then
    checks the row with its own message)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: file not found")
    if not p.is_file():
        raise DataError(f"{path}: not a file")
    try:
        f = p.open("rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open: {e.strerror or e}") from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}: "
            try:
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError as e:
                raise DataError(where + f"not valid UTF-8 (byte {e.start + 1})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise DataError(where + f"invalid JSON: {e.msg} (column {e.colno})") from e
            if require_object and not isinstance(row, dict):
                raise DataError(where + f"expected a JSON object, got {_json_type(row)}")
            yield lineno, row


def _required_str(row: dict[str, Any], key: str, where: str) -> str:
    if key not in row:
        raise DataError(where + f"missing required field {key!r}")
    value = row[key]
    if not isinstance(value, str):
        raise DataError(where + f"field {key!r} must be a string, got {_json_type(value)}")
    return value


def _load(path: str | Path, parse: Callable[[dict[str, Any], str], T]) -> list[T]:
    records = [parse(row, f"{path}:{lineno}: ") for lineno, row in iter_jsonl_objects(path)]
    if not records:
        raise DataError(f"{path}: no records (the file is empty)")
    return records


def _sft_row(row: dict[str, Any], where: str) -> SFTRecord:
    prompt = _required_str(row, "prompt", where)
    if "segments" not in row:
        return SFTRecord(prompt=prompt, response=_required_str(row, "response", where))
    raw = row["segments"]
    if not isinstance(raw, list) or not raw:
        raise DataError(where + "field 'segments' must be a non-empty array of {text, train}")
    segments = []
    for i, seg in enumerate(raw):
        at = where + f"segments[{i}]: "
        if not isinstance(seg, dict):
            raise DataError(at + f"expected an object {{text, train}}, got {_json_type(seg)}")
        text = _required_str(seg, "text", at)
        train = seg.get("train", True)
        if not isinstance(train, bool):
            raise DataError(at + f"field 'train' must be a boolean, got {_json_type(train)}")
        segments.append((text, train))
    joined = "".join(t for t, _ in segments)
    if "response" in row and _required_str(row, "response", where) != joined:
        raise DataError(where + "field 'response' differs from the segments' texts joined")
    return SFTRecord(prompt, joined, tuple(segments))


def load_sft_jsonl(path: str | Path) -> list[SFTRecord]:
    """Load SFT pairs: ``prompt`` and ``response`` (strings, required); other fields are
    ignored. Optional ``segments``: ``[{"text": str, "train": bool}, ...]`` splitting the
    response into pieces the loss covers (``train``, default true) or skips (an environment's
    observations); ``response`` may then be left out, and if given must equal the texts joined.
    Blank lines are skipped. Raises ``DataError`` (``"{path}:{lineno}: ..."``) on a bad line,
    and ``DataError`` naming the path when the file is missing or has no rows."""
    return _load(path, _sft_row)


def _to_row(row: Any) -> dict[str, Any]:
    if hasattr(row, "to_dict"):
        return row.to_dict()
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    if isinstance(row, dict):
        return row
    raise TypeError(f"write_jsonl: cannot write a {type(row).__name__} row")


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> int:
    """Write ``rows`` (dicts, ``PromptRecord`` / ``SFTRecord`` or other dataclasses) as
    JSONL, atomically and durably: streamed into a temp file beside ``path``, which is fsynced,
    renamed over ``path``, and the directory fsynced (``relayrl.durable``'s helpers; parent
    directories it creates are fsynced into theirs). Returns the count."""
    p = Path(path)
    mkdir_durable(p.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(_to_row(row), ensure_ascii=False) + "\n")
                n += 1
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dataset is a normal readable file
        fsync_file(Path(tmp))
        replace_durable(Path(tmp), p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n

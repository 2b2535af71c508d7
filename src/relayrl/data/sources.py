"""Prompt datasets from JSONL, Parquet and local Hugging Face datasets, one row format.

``load_prompt_dataset(path)`` picks the reader from what ``path`` is:

- a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: then
  ``split`` chooses, default ``"train"``) -> ``datasets.load_from_disk``;
- a ``.parquet`` file, or a directory of them -> ``pyarrow.parquet`` (files sorted by path);
- anything else -> JSONL (``relayrl.data.jsonl``), with ``file:line`` errors;
- a spec that is no path, ``reasoning_gym:<task>?size=N&seed=S`` or ``humaneval`` -> the
  built-in task sources (``relayrl.data.task_sources``).

Each row becomes a ``PromptRecord``: ``prompt_key`` (a string; or, when the row has no prompt
but a ``messages`` list of chat turns, the content of its last user turn, the turns kept in
``extra["messages"]`` for the chat template), ``answer_key`` (string or number, stored as a
string) and every other column in ``extra``. With ``require_answer`` a row without an answer
is an error naming the row ("the reward needs it"), not a silently unscorable prompt.
Errors are ``DataError`` with ``path[row N]: ...`` (``path:line: ...`` for JSONL).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relayrl.data.arrow_rows import hf_dataset, is_hf_dir, parquet_files, read_parquet
from relayrl.data.jsonl import DataError, _json_type, iter_jsonl_objects
from relayrl.data.records import PromptRecord
from relayrl.data.task_sources import is_task_source, load_task_source

__all__ = ["load_prompt_dataset", "prompt_from_row"]


def prompt_from_row(
    row: dict[str, Any],
    where: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = False,
) -> PromptRecord:
    """One dataset row as a ``PromptRecord`` (see the module docstring); ``where`` prefixes
    the ``DataError`` messages."""
    extra: dict[str, Any] = {}
    if prompt_key in row and row[prompt_key] is not None:
        prompt = row[prompt_key]
        if not isinstance(prompt, str):
            raise DataError(
                where + f"field {prompt_key!r} must be a string, got {_json_type(prompt)}"
            )
    elif isinstance(row.get("messages"), list):
        messages = row["messages"]
        users = [
            m
            for m in messages
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
        ]
        if not users:
            raise DataError(where + "field 'messages' has no user turn with string content")
        prompt = users[-1]["content"]
        extra["messages"] = messages
    else:
        raise DataError(where + f"missing required field {prompt_key!r}")
    answer = row.get(answer_key)
    if answer is None:
        if require_answer:
            raise DataError(
                where + f"missing required field {answer_key!r} (the reward needs a reference "
                "answer; set data.answer_key or data.require_answer=false)"
            )
    else:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataError(
                where + f"field {answer_key!r} must be a string or number, got {_json_type(answer)}"
            )
        answer = str(answer)
    for k, v in row.items():
        if k not in (prompt_key, answer_key, "messages"):
            extra[k] = v
    return PromptRecord(prompt=prompt, answer=answer, extra=extra)


def _hf_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    """The rows of a saved dataset (as ``datasets`` yields them) or of Parquet file(s) (as
    ``pyarrow`` converts them: the same Python values), in order."""
    if is_hf_dir(path):
        yield from hf_dataset(path, split)
        return
    for batch in read_parquet(path).to_batches(max_chunksize=4096):
        yield from batch.to_pylist()


def load_prompt_dataset(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = False,
    split: str | None = None,
) -> list[PromptRecord]:
    """Load RL prompts from JSONL, Parquet or a saved Hugging Face dataset (see the module
    docstring). Raises ``DataError`` for a missing path, an empty dataset or a bad row."""
    p = Path(path)
    if not p.exists() and is_task_source(path):  # reasoning_gym:<task>, humaneval
        return load_task_source(str(path))
    if not p.exists():
        raise DataError(f"{path}: file not found")
    records: list[PromptRecord] = []
    if is_hf_dir(p) or parquet_files(p):
        for i, row in enumerate(_hf_rows(p, split)):
            records.append(
                prompt_from_row(row, f"{path}[row {i}]: ", prompt_key, answer_key, require_answer)
            )
    elif p.is_dir():
        raise DataError(f"{path}: a directory that is neither a saved dataset nor Parquet files")
    else:
        for lineno, row in iter_jsonl_objects(p):
            records.append(
                prompt_from_row(row, f"{path}:{lineno}: ", prompt_key, answer_key, require_answer)
            )
    if not records:
        raise DataError(f"{path}: no records (the dataset is empty)")
    return records

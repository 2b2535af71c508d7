"""Reading a prompt dataset: JSONL, Parquet or a saved Hugging Face dataset, one row format,
one loader (``load_prompts``).

``load_prompts(path)`` picks the reader from what ``path`` is:

- a directory written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: then
  ``split`` chooses, default ``"train"``) -> ``datasets.load_from_disk``;
- a ``.parquet`` file, or a directory of them -> ``pyarrow.parquet`` (files sorted by path);
- anything else -> JSONL, with ``file:line`` errors;
- a spec that is no path, ``reasoning_gym:<task>?size=N&seed=S`` or ``humaneval`` -> the
  built-in task sources (``relayrl.data.task_sources``).

Each row becomes a ``PromptRecord`` (``prompt_from_row``): ``prompt_key`` (a string; or, when
the row has no prompt but a ``messages`` list of chat turns, the content of its last user turn,
the turns kept in ``extra["messages"]`` for the chat template), ``answer_key`` (string or
number, stored as a string) and every other column in ``extra``. With ``require_answer`` a row
without an answer is an error naming the row ("the reward needs it"), not a silently
unscorable prompt. Errors are ``DataError`` with ``path[row N]: ...`` (``path:line: ...`` for
JSONL); a missing path, an empty dataset or a directory that is neither form is one too.

``load_prompts`` checks every row up front but returns ``PromptRows``, which builds a row's
record only when it is asked for: building a million ``PromptRecord`` objects (and their
``extra`` dicts) costs as much again as parsing the file, and a run only ever looks at the
rows it draws. Every row's prompt string is kept, because the held-out split
(``relayrl.data.prompts.hold_out``) needs them all.

A JSONL file is decoded in one pass (the file's bytes, split on ``\\n``, each line through
the ``json`` module's C scanner, which is what ``json.loads`` runs less two regex matches)
with a check of the prompt and answer fields per row; a file with a bad line (or rows in the
chat ``messages`` form) goes through the row-by-row reader (``records_row_by_row``) instead,
which raises the exact error (the two readers' times: docs/measurements.md).

A Parquet file (or directory of them) or a saved Hugging Face dataset is kept as its Arrow
table (``relayrl.data.prompts.arrow``): the prompt column is read once as a list of strings
and the column types are checked, so no row needs a check of its own; a row becomes a dict and
a record when it is drawn. A table that needs per-row checks (nulls in the prompt column, an
answer column of another type, chat ``messages`` rows, features ``datasets`` decodes) goes
through the row-by-row reader, which raises the exact ``path[row N]: ...`` error
(``bench/prompt_sampling.py --format parquet`` / ``hf`` measures start-up; figures in
docs/measurements.md).
"""

from __future__ import annotations

import bisect
import itertools
import json
import json.scanner
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast, overload

from relayrl.data.jsonl import DataError, _json_type, iter_jsonl_objects
from relayrl.data.prompts.arrow import (
    arrow_table,
    hf_dataset,
    is_hf_dir,
    parquet_files,
    prompt_columns,
    read_parquet,
)
from relayrl.data.records import PromptRecord
from relayrl.data.task_sources import is_task_source, load_task_source

__all__ = ["PromptRows", "load_prompts", "prompt_from_row", "records_row_by_row"]


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


def records_row_by_row(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = False,
    split: str | None = None,
) -> list[PromptRecord]:
    """Every row of the dataset at ``path`` as a ``PromptRecord``, checked one by one: the
    reference reader that ``load_prompts`` falls back to for the exact ``DataError`` (a missing
    path, an empty dataset, a bad row) and for rows its fast readers do not take."""
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


class PromptRows(Sequence[PromptRecord]):
    """Rows of a prompt dataset (checked), as a sequence of ``PromptRecord`` built on access.

    Backed by the decoded JSON objects (``rows``), records built already (``records``) or an
    Arrow table (``table``, a ``pyarrow.Table``). ``prompt(i)`` is row ``i``'s prompt string
    without building its record; ``is_blank(i)`` says the row has an empty prompt and no chat
    turns (tokenising skips those); ``records(indices)`` builds several at once.
    """

    def __init__(
        self,
        prompts: list[str],
        rows: list[dict[str, Any]] | None = None,
        records: list[PromptRecord] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        table: Any = None,
    ) -> None:
        if sum(x is not None for x in (rows, records, table)) != 1:
            raise ValueError("PromptRows: give exactly one of rows, records or table")
        self.prompts = prompts
        self._rows = rows
        self._records = records
        self._table = table
        self._batches: list[Any] | None = None  # the table's record batches, on first use
        self._starts: list[int] = []  # row count up to and including each batch
        self._keys = (prompt_key, answer_key)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_batches"], state["_starts"] = None, []  # views of the table: rebuilt on use
        return state

    @classmethod
    def of(cls, records: list[PromptRecord]) -> PromptRows:
        """Rows over records already built."""
        return cls([r.prompt for r in records], records=records)

    def __len__(self) -> int:
        return len(self.prompts)

    @overload
    def __getitem__(self, i: int) -> PromptRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[PromptRecord]: ...
    def __getitem__(self, i: int | slice) -> PromptRecord | list[PromptRecord]:
        if isinstance(i, slice):
            return self.records(range(*i.indices(len(self))))
        if self._records is not None:
            return self._records[i]
        # checked at load: prompt_from_row cannot raise here
        return prompt_from_row(self._row(i), "", *self._keys)

    def records(self, indices: Sequence[int]) -> list[PromptRecord]:
        """The records of rows ``indices``."""
        if self._records is not None:
            return [self._records[i] for i in indices]
        return [prompt_from_row(self._row(i), "", *self._keys) for i in indices]

    def _row(self, i: int) -> dict[str, Any]:
        """Row ``i`` as a dict; of a table, a one-row slice of the record batch holding it
        (``Table.take`` concatenates a column's chunks first: O(rows) a call; a slice of the
        batch is O(log batches))."""
        if self._table is None:
            assert self._rows is not None
            return self._rows[i]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        if self._batches is None:
            self._batches = self._table.to_batches()  # zero-copy
            self._starts = list(itertools.accumulate(b.num_rows for b in self._batches))
        k = bisect.bisect_right(self._starts, i)
        start = self._starts[k - 1] if k else 0
        return self._batches[k].slice(i - start, 1).to_pylist()[0]

    def __iter__(self) -> Iterator[PromptRecord]:
        for i in range(len(self)):
            yield self[i]

    def prompt(self, i: int) -> str:
        return self.prompts[i]

    def is_blank(self, i: int) -> bool:
        if self.prompts[i].strip():
            return False
        if self._records is not None:
            return not self._records[i].extra.get("messages")
        if self._table is not None:
            if "messages" not in self._table.column_names:
                return True
            return not self._table.column("messages")[i].as_py()
        assert self._rows is not None
        return not self._rows[i].get("messages")


def _arrow_rows(
    path: Path, prompt_key: str, answer_key: str, require_answer: bool, split: str | None
) -> PromptRows | None:
    """A Parquet / saved-dataset table kept whole (module docstring); None when its rows need
    the row-by-row reader."""
    table, plain = arrow_table(path, split)
    prompts = prompt_columns(table, prompt_key, answer_key, require_answer) if plain else None
    if prompts is None:
        return None
    return PromptRows(prompts, table=table, prompt_key=prompt_key, answer_key=answer_key)


def _fast_jsonl(
    path: Path, prompt_key: str, answer_key: str, require_answer: bool
) -> PromptRows | None:
    """The one-pass reader (module docstring); None when the file needs the row-by-row one
    (a line that does not decode, is not an object, or has a prompt/answer field that is not
    a plain string / number: that reader raises the exact error, or handles ``messages``)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.startswith("\ufeff"):
        text = text[1:]
    # json.loads(line) is: skip JSON whitespace, scan one value, only whitespace after it;
    # the C scanner called directly does the same without two regex matches per line
    scan = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))  # typeshed: a context
    rows: list[Any] = []
    append_row = rows.append
    try:
        for line in text.split("\n"):
            s = line.strip(" \t\r\n")
            if s:
                row, end = scan(s, 0)
                if end != len(s):
                    return None
                append_row(row)
    except (StopIteration, ValueError, RecursionError):
        return None
    prompts: list[str] = []
    append = prompts.append
    for row in rows:
        if type(row) is not dict:
            return None
        p = row.get(prompt_key)
        if type(p) is not str:
            return None
        a = row.get(answer_key)
        if a is None:
            if require_answer:
                return None
        elif type(a) is not str and type(a) is not int and type(a) is not float:
            return None
        append(p)
    return PromptRows(prompts, rows=rows, prompt_key=prompt_key, answer_key=answer_key)


def load_prompts(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = False,
    split: str | None = None,
) -> PromptRows:
    """The prompt dataset at ``path`` (JSONL, Parquet or a saved Hugging Face dataset), every
    row checked, as ``PromptRows`` (module docstring). Raises ``DataError`` for a missing path,
    an empty dataset or a bad row."""
    p = Path(path)
    if is_hf_dir(p) or parquet_files(p):
        table = _arrow_rows(p, prompt_key, answer_key, require_answer, split)
        if table is not None:
            return table
    elif p.is_file():
        fast = _fast_jsonl(p, prompt_key, answer_key, require_answer)
        if fast is not None:
            if not len(fast):
                raise DataError(f"{path}: no records (the dataset is empty)")
            return fast
    return PromptRows.of(
        records_row_by_row(
            path,
            prompt_key=prompt_key,
            answer_key=answer_key,
            require_answer=require_answer,
            split=split,
        )
    )

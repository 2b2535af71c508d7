"""Parquet files and saved Hugging Face datasets as Arrow tables, and their prompt columns.

``arrow_table(path, split)`` reads what ``relayrl.data.prompts.read`` accepts besides JSONL:

- a ``.parquet`` file or a directory of them (sorted by path, rows numbered across the files
  in that order) through ``pyarrow.parquet`` (no ``datasets`` cache is written);
- a directory from ``datasets.Dataset.save_to_disk`` (a ``DatasetDict``: ``split``, default
  ``"train"``) through ``datasets.load_from_disk``, memory-mapped.

``prompt_columns`` is the check that lets a caller keep such a table as it is and build a
row's record only when it is drawn: the prompt column is a string column without nulls, the
answer column (if any) holds strings or numbers (no nulls when the answer is required), and
converting the table to Python gives what ``datasets`` yields for its rows (no feature that
``datasets`` decodes, such as images). Anything else returns None: the caller then goes
through the row-by-row reader, which raises the exact ``path[row N]: ...`` error or handles
rows in the chat ``messages`` form. A row read from the table is ``table.slice(i, 1)
.to_pylist()[0]``, what ``datasets`` formats a row as for those features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relayrl.data.jsonl import DataError

__all__ = ["arrow_table", "hf_dataset", "is_hf_dir", "parquet_files", "prompt_columns"]


def is_hf_dir(p: Path) -> bool:
    """A directory written by ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``)."""
    return p.is_dir() and any(
        (p / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def parquet_files(p: Path) -> list[Path]:
    """``p`` itself when it is a ``.parquet`` file, the ones under a directory, else []."""
    if p.is_file() and p.suffix == ".parquet":
        return [p]
    if p.is_dir():
        return sorted(p.rglob("*.parquet"))
    return []


def hf_dataset(path: Path, split: str | None) -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (of a ``DatasetDict``: ``split``, default
    ``"train"``); ``DataError`` naming the path when it cannot be loaded or has no such split."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise DataError(f"{path}: reading it needs the 'datasets' package") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: cannot load the dataset: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name is None or name not in ds:
            raise DataError(f"{path}: no split {split!r} (has {sorted(ds)}); set data.split")
        ds = ds[name]
    return ds


def read_parquet(path: Path) -> Any:
    """The rows of the Parquet file(s) at ``path`` as one ``pyarrow.Table`` (files in
    ``parquet_files`` order; columns a later file lacks are null there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        tables = [pq.read_table(f) for f in parquet_files(path)]
        if len(tables) == 1:
            return tables[0]
        return pa.concat_tables(tables, promote_options="default")
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read Parquet: {e}") from e


def arrow_table(path: Path, split: str | None) -> tuple[Any, bool]:
    """(the dataset at ``path`` as a ``pyarrow.Table``, whether its rows convert to Python as
    ``datasets`` yields them: always for Parquet; for a saved dataset when no feature needs
    ``datasets``' decoding)."""
    if not is_hf_dir(path):
        return read_parquet(path), True
    from datasets.features.features import require_decoding

    ds = hf_dataset(path, split)
    plain = not any(require_decoding(f) for f in ds.features.values())
    return ds.with_format("arrow")[:], plain


def _is_string(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _answer_type_ok(t: Any) -> bool:
    import pyarrow as pa

    return _is_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)


def prompt_columns(
    table: Any, prompt_key: str, answer_key: str, require_answer: bool
) -> list[str] | None:
    """Every row's prompt string when the table's rows need no per-row check (module
    docstring), else None."""
    names = table.column_names
    if table.num_rows == 0 or prompt_key not in names:
        return None
    prompt = table.column(prompt_key)
    if not _is_string(prompt.type) or prompt.null_count:
        return None
    if answer_key in names:
        answer = table.column(answer_key)
        if not _answer_type_ok(answer.type) or (require_answer and answer.null_count):
            return None
    elif require_answer:
        return None
    return prompt.to_pylist()

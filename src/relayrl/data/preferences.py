"""Preference pairs (``prompt``, ``chosen``, ``rejected``) from JSONL or a local HF dataset.

Shared by reward-model training and DPO. Bad rows are handled in two ways:

- a row that is malformed (missing field, non-string value, invalid JSON) is a ``DataError``
  naming ``file:line`` (or ``dataset[row]``): the file is wrong and must be fixed;
- a row that is well-formed but carries no usable preference is skipped and counted by
  reason: ``identical`` (chosen == rejected after stripping whitespace: no information) and
  ``empty_completion`` (chosen or rejected is empty or blank).

A file whose rows are all skipped is a ``DataError`` too.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.data import DataError
from relayrl.data.jsonl import iter_jsonl_objects

__all__ = [
    "PreferenceData",
    "PreferencePair",
    "load_preferences",
    "split_pairs",
    "write_preferences",
]

REQUIRED = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    """One comparison: ``chosen`` is preferred over ``rejected`` as a completion of
    ``prompt``. ``extra`` keeps any other fields of the row (e.g. true scores in the lab)."""

    prompt: str
    chosen: str
    rejected: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            **self.extra,
        }


@dataclass
class PreferenceData:
    """Usable pairs and the count of skipped rows per reason."""

    pairs: list[PreferencePair]
    skipped: Counter[str] = field(default_factory=Counter)
    source: str = ""

    def skip_summary(self) -> str:
        """``"skipped 3 rows (identical: 2, empty_completion: 1)"`` or ``""``."""
        n = sum(self.skipped.values())
        if n == 0:
            return ""
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        return f"{self.source}: skipped {n} preference rows ({parts})"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _parse_row(row: Any, where: str, skipped: Counter[str]) -> PreferencePair | None:
    if not isinstance(row, dict):
        raise DataError(
            f"{where}expected an object with prompt/chosen/rejected, got {_type_name(row)}"
        )
    for key in REQUIRED:
        if key not in row:
            raise DataError(f"{where}missing required field {key!r}")
        if not isinstance(row[key], str):
            raise DataError(f"{where}field {key!r} must be a string, got {_type_name(row[key])}")
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if not chosen.strip() or not rejected.strip():
        skipped["empty_completion"] += 1
        return None
    if chosen.strip() == rejected.strip():
        skipped["identical"] += 1
        return None
    extra = {k: v for k, v in row.items() if k not in REQUIRED}
    return PreferencePair(prompt, chosen, rejected, extra)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line: `` prefix, JSON object) per non-blank line, via the data layer's reader."""
    for lineno, row in iter_jsonl_objects(path, require_object=False):
        yield f"{path}:{lineno}: ", row


def _hf_dataset_rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    """Rows of a dataset saved with ``datasets``' ``save_to_disk`` (a Dataset or a
    DatasetDict, whose ``split`` -- default ``train`` -- is used)."""
    try:
        import datasets  # optional dependency: only needed for HF dataset directories
    except ImportError as e:
        raise DataError(
            f"{path}: reading a Hugging Face dataset directory needs the 'datasets' package "
            "(pip install datasets), or convert it to JSONL"
        ) from e
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # any loader failure is a data error naming the path
        raise DataError(f"{path}: cannot load Hugging Face dataset: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        name = split or "train"
        if name not in ds:
            raise DataError(f"{path}: dataset has no split {name!r} (splits: {sorted(ds)})")
        ds = ds[name]
    missing = [k for k in REQUIRED if k not in ds.column_names]
    if missing:
        raise DataError(f"{path}: dataset is missing required column {missing[0]!r}")
    for i, row in enumerate(ds):
        yield f"{path}[{i}]: ", row


def load_preferences(path: str | Path, split: str | None = None) -> PreferenceData:
    """Load preference pairs from a JSONL file or a local Hugging Face dataset directory.

    Raises ``DataError`` on a missing file, a malformed row, or when no usable pair is left;
    skipped rows (identical or empty completions) are counted in ``PreferenceData.skipped``.
    """
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: file not found")
    rows = _hf_dataset_rows(p, split) if p.is_dir() else _jsonl_rows(p)
    skipped: Counter[str] = Counter()
    pairs = [pair for where, row in rows if (pair := _parse_row(row, where, skipped))]
    data = PreferenceData(pairs, skipped, str(path))
    if not pairs:
        why = f" ({data.skip_summary()})" if skipped else " (the file is empty)"
        raise DataError(f"{path}: no usable preference pairs{why}")
    return data


def write_preferences(path: str | Path, pairs: Sequence[PreferencePair]) -> int:
    """Write pairs as JSONL (one object per line); returns the count."""
    from relayrl.data import write_jsonl

    return write_jsonl(path, (pair.to_dict() for pair in pairs))


def split_pairs(
    pairs: Sequence[PreferencePair], eval_fraction: float, seed: int
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """A seeded shuffle cut into (train, held-out) by prompt: a prompt's pairs all go to the
    same side (several pairs per prompt, as in UltraFeedback or HH, would otherwise put the
    held-out prompts, often the very completions, in training: an optimistic held-out
    accuracy). Prompts are taken in shuffled order, each one that brings the held-out count
    closer to ``round(eval_fraction * n)`` pairs (one pair per prompt: exactly that many, the
    first of the shuffle; few prompts: the nearest whole prompts). At least one pair on each
    side when there are two or more pairs and ``eval_fraction`` > 0; when no whole prompt comes
    nearer the share than none (one prompt, or each with over twice the held-out count), pairs
    are split instead, as before."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    if eval_fraction <= 0 or len(order) < 2:
        return order, []
    n_eval = min(len(order) - 1, max(1, round(eval_fraction * len(order))))
    per_prompt = Counter(p.prompt for p in order)
    held: set[str] = set()
    count = 0
    for p in order:
        k = per_prompt[p.prompt]
        if p.prompt in held or count + k > len(order) - 1:  # keep a training pair
            continue
        if abs(count + k - n_eval) < abs(count - n_eval):  # closer to the target share
            held.add(p.prompt)
            count += k
    if not held:  # no whole prompt fits the share: split pairs
        return order[n_eval:], order[:n_eval]
    return [p for p in order if p.prompt not in held], [p for p in order if p.prompt in held]

"""A training file's prompts, tokenised when first drawn, and the held-out split over its rows.

Tokenising a million prompts once costs ~45 s on one core (~45 us a prompt); a run draws
``steps x prompts_per_step`` of them (a JSONL, Parquet or saved-dataset file: its rows are
``relayrl.data.rows.PromptRows``). ``RowCache`` tokenises a row the first time it is
asked for (one tokenizer call per batch of rows) and keeps the result: a ``TokenizedPrompt``,
or ``None`` for a row that is skipped (blank, or longer than ``data.max_prompt_tokens``),
counted in its ``SkipReport`` once per row. A file of at most ``PRETOKENIZE`` rows is
tokenised whole at construction, so a small file reports its skips, or that no prompt is
usable, before the run starts, as before.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.data import DataError, PromptRecord, SkipReport
from relayrl.data.prompting import encode_prompts

PRETOKENIZE = 4096
"""Rows tokenised at construction: a whole file up to this size; for a larger one the first
``PRETOKENIZE`` rows of epoch 0's order (the first ones drawn), which is also the sample the
preflight context check looks at."""


@dataclass
class TokenizedPrompt:
    record: PromptRecord
    ids: list[int]

    def fields(self) -> dict[str, Any]:
        """Sample fields handed to the reward function."""
        return {**self.record.extra, "prompt": self.record.prompt, "answer": self.record.answer}


_UNSEEN = object()


class RowCache:
    """Row ``i`` of ``rows`` as a ``TokenizedPrompt`` (None: skipped), tokenised on first use."""

    def __init__(
        self,
        rows: Sequence[PromptRecord],
        tokenizer: Any,
        max_tokens: int,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        source: str = "",
    ) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.source = source
        self._encode_args = (use_chat_template, system_prompt)
        self._cache: list[Any] = [_UNSEEN] * len(rows)
        self.report = SkipReport(max_tokens=max_tokens)
        self.seen = 0
        self._lock = threading.Lock()  # a row is tokenised and counted once across threads

    @classmethod
    def of(cls, prompts: Sequence[TokenizedPrompt]) -> RowCache:
        """A cache over prompts tokenised already."""
        out = cls([p.record for p in prompts], None, max(len(p.ids) for p in prompts))
        out._cache = list(prompts)
        out.seen = out.report.total = len(prompts)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, rows: Sequence[int]) -> list[TokenizedPrompt | None]:
        """The rows, tokenising the ones not seen yet in one batch."""
        cache = self._cache
        if any(cache[i] is _UNSEEN for i in rows):
            with self._lock:
                todo = sorted({i for i in rows if cache[i] is _UNSEEN})
                batch = getattr(self.rows, "records", None)  # PromptRows: in one call
                records = batch(todo) if batch is not None else [self.rows[i] for i in todo]
                encoded = encode_prompts(records, self.tokenizer, *self._encode_args)
                for i, rec, ids in zip(todo, records, encoded, strict=True):
                    cache[i] = TokenizedPrompt(rec, ids) if self.report.note(rec, ids) else None
                self.seen += len(todo)
                self.report.total = self.seen
        return [cache[i] for i in rows]

    def tokenized(self) -> list[TokenizedPrompt]:
        """The usable prompts tokenised so far, in row order."""
        return [p for p in self._cache if p is not _UNSEEN and p is not None]

    def scan_all(self, batch: int = 1024) -> list[int]:
        """Tokenise every row; the usable rows. None usable is a ``DataError`` saying why
        (``SkipReport.why_none``)."""
        for lo in range(0, len(self), batch):
            self.get(range(lo, min(lo + batch, len(self))))
        usable = [i for i, p in enumerate(self._cache) if p is not None]
        if not usable:
            raise DataError(self.report.why_none(self.source))
        return usable


def hold_out_rows(
    prompts: Sequence[str],
    candidates: Sequence[int],
    cache: RowCache,
    n: int,
    seed: int,
    where: str,
) -> tuple[set[str], list[TokenizedPrompt]]:
    """``n`` distinct prompts among the rows ``candidates`` (the non-blank rows), drawn with
    the run's seed, as the eval set (each prompt's first row, in file order): the prompts
    ``random.Random(f"relayrl.hold_out:{seed}").sample(distinct, n)`` picks, ``distinct`` the
    candidates' prompts in order of first appearance. A chosen prompt that is too long to use is
    replaced by further draws of the same generator (``randrange`` over ``distinct``, skipping
    prompts chosen already). Returns (every chosen prompt, the too-long ones included: their
    rows all leave training; the eval set). At most half of the distinct prompts are held out:
    more is an error naming both keys (``where`` is the file)."""
    cand = prompts if len(candidates) == len(prompts) else [prompts[i] for i in candidates]
    rows = candidates if len(candidates) == len(prompts) else list(candidates)
    distinct = list(dict.fromkeys(cand))  # in order of first appearance
    # each prompt's first row: later assignments win, so assign from the end
    first = dict(zip(reversed(cand), reversed(rows), strict=True))

    def too_few(count: int) -> ValueError:
        return ValueError(
            f"{where}: {count} distinct usable prompts; holding out "
            f"data.eval_size={n} for the evaluation would leave {count - n} to train "
            "on: set data.eval_path or a smaller data.eval_size"
        )

    if len(distinct) < 2 * n:
        raise too_few(len(distinct))
    rng = random.Random(f"relayrl.hold_out:{seed}")
    chosen = rng.sample(distinct, n)
    chosen_set = set(chosen)
    got = cache.get([first[p] for p in chosen])
    kept = [first[p] for p, t in zip(chosen, got, strict=True) if t is not None]
    attempts = 0
    while len(kept) < n and attempts < 20 * n + 1000:
        attempts += 1
        p = distinct[rng.randrange(len(distinct))]
        if p in chosen_set:
            continue
        chosen_set.add(p)
        if cache.get([first[p]])[0] is not None:
            kept.append(first[p])
    if len(kept) < n:  # most prompts too long: look at all of them
        cache.scan_all()
        usable_distinct = [p for p in distinct if cache.get([first[p]])[0] is not None]
        if len(usable_distinct) < 2 * n:
            raise too_few(len(usable_distinct))
        rest = [p for p in usable_distinct if p not in chosen_set]
        for p in rng.sample(rest, n - len(kept)):
            chosen_set.add(p)
            kept.append(first[p])
    eval_set = [t for t in cache.get(sorted(kept)) if t is not None]
    return chosen_set, eval_set

"""Tokenising once and the length filter: prompt text to token ids, a report of what was skipped.

``encode_prompts`` renders each record (``relayrl.data.prompts.template.render_prompt``) and
tokenises it once (token in, token out); ``SkipReport.note`` is the length filter: a prompt
that is empty or longer than ``max_tokens`` (``data.max_prompt_tokens``) is skipped and
counted. ``RowCache`` puts the two together over a dataset's rows, a row tokenised the first
time it is asked for and kept (a ``TokenizedPrompt``, or ``None`` when skipped, counted once
per row), so a run of a million rows starts in seconds and tokenises only what it draws.
``tokenize_prompts`` is the same over a list, all at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.data.jsonl import DataError
from relayrl.data.prompts.template import render_prompt
from relayrl.data.records import PromptRecord

__all__ = [
    "RowCache",
    "SkipReport",
    "TokenizedPrompt",
    "encode_prompts",
    "tokenize_prompts",
]

TOKENIZE_BATCH = 1024
"""Rendered prompts per tokenizer call in ``tokenize_prompts``."""


@dataclass
class TokenizedPrompt:
    """A prompt ready to roll out: its record and its token ids (rendered, tokenised once)."""

    record: PromptRecord
    ids: list[int]

    def fields(self) -> dict[str, Any]:
        """Sample fields handed to the reward function."""
        return {**self.record.extra, "prompt": self.record.prompt, "answer": self.record.answer}


@dataclass
class SkipReport:
    """Prompts dropped by the length filter: how many, why, and a few examples."""

    total: int = 0
    too_long: int = 0
    empty: int = 0
    max_tokens: int = 0
    longest: int = 0
    """Token count of the longest prompt skipped for length (0 when none was)."""
    examples: list[str] = field(default_factory=list)

    def note(self, rec: PromptRecord, ids: list[int]) -> bool:
        """Count ``rec`` (tokenised to ``ids``) as kept (True) or skipped: empty, or longer
        than ``max_tokens`` (False)."""
        if not ids:
            self.empty += 1
            return False
        if len(ids) > self.max_tokens:
            self.too_long += 1
            self.longest = max(self.longest, len(ids))
            if len(self.examples) < 3:
                self.examples.append(rec.prompt[:80])
            return False
        return True

    @property
    def skipped(self) -> int:
        return self.too_long + self.empty

    def message(self) -> str:
        """One line for the log ('' when nothing was skipped)."""
        if not self.skipped:
            return ""
        return (
            f"skipped {self.skipped} of {self.total} prompts ({self.too_long} longer than "
            f"{self.max_tokens} tokens, {self.empty} empty)"
        )

    def why_none(self, source: str, key: str = "data.max_prompt_tokens") -> str:
        """Why no prompt of ``source`` was kept, in one line naming the length ``key``:
        ``3 of 3 prompts in p.jsonl are longer than data.max_prompt_tokens=16 tokens
        (longest 40)``."""
        too_long = (
            f"{self.too_long} of {self.total} prompts in {source} are longer than "
            f"{key}={self.max_tokens} tokens (longest {self.longest})"
        )
        if self.too_long == self.total:
            return too_long
        if self.empty == self.total:
            return f"{source}: no usable prompts: all {self.total} are empty"
        if self.too_long:
            return f"no usable prompts: {too_long}, and {self.empty} are empty"
        return f"{source}: no usable prompts"


def encode_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Each record's rendered prompt (``render_prompt``) as token ids, ``[]`` for a blank one
    (an empty prompt without chat turns). With a chat template the rendered text already holds
    the special tokens the template wants, so it is tokenised without adding more.

    A ``transformers`` tokenizer gets one call per run of consecutive rows rendered the same
    way (the same ids as a call per row, a third less time on a fast tokenizer); any other
    tokenizer is called once per prompt."""
    from transformers import PreTrainedTokenizerBase  # lazy: data loads without it

    batched = isinstance(tokenizer, PreTrainedTokenizerBase)
    out: list[list[int]] = [[] for _ in records]
    run: list[tuple[int, str]] = []
    run_templated = False

    def flush() -> None:
        if not run:
            return
        texts = [t for _, t in run]
        if batched:
            enc = tokenizer(texts, add_special_tokens=not run_templated).input_ids
        else:
            enc = [tokenizer(t, add_special_tokens=not run_templated).input_ids for t in texts]
        for (i, _), ids in zip(run, enc, strict=True):
            out[i] = list(ids)
        run.clear()

    for i, rec in enumerate(records):
        if not rec.prompt.strip() and not rec.extra.get("messages"):
            continue
        text, templated = render_prompt(rec, tokenizer, use_chat_template, system_prompt)
        if run and templated != run_templated:
            flush()
        run_templated = templated
        run.append((i, text))
    flush()
    return out


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


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    max_tokens: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> tuple[list[TokenizedPrompt], SkipReport]:
    """Render (chat template) and tokenise each prompt once, ``TOKENIZE_BATCH`` at a time
    (``RowCache``); skip blank ones and those over ``max_tokens`` tokens. Returns the kept
    prompts, in order, and the ``SkipReport``."""
    cache = RowCache(records, tokenizer, max_tokens, use_chat_template, system_prompt)
    kept: list[TokenizedPrompt] = []
    for lo in range(0, len(records), TOKENIZE_BATCH):
        got = cache.get(range(lo, min(lo + TOKENIZE_BATCH, len(records))))
        kept += [p for p in got if p is not None]
    return kept, cache.report

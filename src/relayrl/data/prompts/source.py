"""The per-step draw and the eval set: what the controller asks the prompt pipeline for.

``PromptSource(cfg.data, tokenizer, seed)`` builds the whole pipeline from ``cfg.data`` in one
place (the source ``open_task`` names, read, templated, tokenised, length-filtered, the
hold-out split); ``for_step(step, n)`` is a step's prompts and ``eval_set()`` the fixed
held-out set. Each step's prompts are a pure function of (seed, step).

Being a pure function of the step keeps resume exact: a resumed run draws the same prompts a
straight run would, with no sampler state to save. For a training file, the prompt stream is
epochs over the file, epoch ``e`` the order ``random.Random(seed * 1_000_003 + e).shuffle``
gives; step ``s`` of ``n`` prompts takes stream positions ``s * n .. s * n + n - 1``. Each
epoch's permutation is built once (O(rows)) and kept (the last ``EPOCH_CACHE`` epochs), so a
step costs O(n) amortised, whatever the file's size.

Prompts are tokenised when first drawn (``relayrl.data.prompts.tokens.RowCache``): the file's
rows are parsed and checked at start, not tokenised, so a million rows start in seconds. The
permutation is over the training rows (the non-blank rows outside the held-out split); a drawn
row that turns out longer than ``data.max_prompt_tokens`` is counted (``skipped``) and replaced
by a row drawn at random: redraw ``k`` = 1, 2, ... of stream position ``p`` is row
``random.Random(f"relayrl.redraw:{seed}:{p}")``'s ``k``-th ``randrange(rows)``, until a usable
one (a pure function of (seed, p): resume stays exact). With no over-long prompt the draws are
those of tokenising everything first.
"""

from __future__ import annotations

import itertools
import operator
import random
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from relayrl.data.jsonl import DataError
from relayrl.data.prompts.hold_out import hold_out_rows
from relayrl.data.prompts.tasks import DatasetTask, GeneratedTask, open_task, read_rows
from relayrl.data.prompts.tokens import RowCache, SkipReport, TokenizedPrompt, tokenize_prompts
from relayrl.data.records import PromptRecord

if TYPE_CHECKING:
    from relayrl.config import DataConfig

__all__ = [
    "EPOCH_CACHE",
    "MAX_REDRAWS",
    "PRETOKENIZE",
    "PromptSource",
    "TokenizedPrompt",
    "epoch_order",
]

PRETOKENIZE = 4096
"""Rows tokenised at construction: a whole file up to this size; for a larger one the first
``PRETOKENIZE`` rows of epoch 0's order (the first ones drawn), which is also the sample the
preflight context check looks at."""

MAX_REDRAWS = 64
"""Random redraws for one over-long prompt before the whole file is tokenised to find the
usable rows (then the redraw picks among those, with the same generator)."""


EPOCH_CACHE = 4
"""Epoch permutations kept per ``PromptSource``: the current epoch, the next (a step that
straddles the boundary), and the dynamic-sampling refill stream's (``algorithms``), which
draws from far-off steps."""


def epoch_order(seed: int, epoch: int, rows: int) -> array:
    """The permutation of ``range(rows)`` that epoch ``epoch`` visits the file in:
    ``random.Random(seed * 1_000_003 + epoch).shuffle`` (4 bytes a row)."""
    order = list(range(rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return array("l", order)


class PromptSource:
    """Training prompts per step, and the fixed held-out eval set.

    ``with_train=False`` (``relayrl eval``) reads only the eval set: a command that does not
    train never opens, or reports errors about, ``data.train_path``, unless the eval set is
    held out of it (a dataset task without ``data.eval_path``: ``hold_out_rows``). A file whose
    every prompt is dropped is a ``DataError`` saying why (``SkipReport.why_none``): at start
    for a file of at most ``PRETOKENIZE`` rows or when none of the first ones drawn is usable,
    else when a draw finds none.

    ``skipped`` counts the prompts skipped so far (blank rows at start; over-long ones as they
    are first drawn, each row once; all of them at start for a small file).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, seed: int, with_train: bool = True):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.task = task = open_task(cfg, seed)
        self._cache: RowCache | None = None
        self._index: array | None = None
        self._eval: list[TokenizedPrompt] | None = None
        self._held_out: set[str] | None = None
        self._usable: list[int] | None = None
        self._orders: OrderedDict[int, array] = OrderedDict()
        if isinstance(task, DatasetTask) and (with_train or cfg.eval_path is None):
            rows = task.rows()
            src = cfg.source
            cache = self._cache = RowCache(
                rows,
                tokenizer,
                cfg.max_prompt_tokens,
                use_chat_template=src.chat_template,
                system_prompt=src.system_prompt,
                source=task.where,
            )
            blank = []
            if not all(map(str.strip, rows.prompts)):
                blank = [
                    i for i, p in enumerate(rows.prompts) if not p.strip() and rows.is_blank(i)
                ]
            if blank:
                cache.get(blank)  # counted as empty, nothing to tokenise
                blank_set = set(blank)
                candidates: Sequence[int] = [i for i in range(len(rows)) if i not in blank_set]
            else:
                candidates = range(len(rows))
            if not candidates or len(rows) <= PRETOKENIZE:
                cache.scan_all()  # a small file: every skip (or that none is usable) now
            held: set[str] = set()
            if cfg.eval_path is None:
                held, self._eval = hold_out_rows(
                    rows.prompts, candidates, cache, cfg.eval_size, seed, task.where
                )
                out = map(held.__contains__, rows.prompts)
                keep = set(candidates) if blank else None
                candidates = [
                    i
                    for i in itertools.compress(range(len(rows)), map(operator.not_, out))
                    if keep is None or i in keep
                ]
            self._index = array("l", candidates)
            first = self._order(0)[: min(len(self._index), PRETOKENIZE)]
            if all(p is None for p in cache.get([self._index[i] for i in first])):
                self._usable_rows()  # none of the first drawn: is any usable at all?

    @property
    def skipped(self) -> int:
        return self._cache.report.skipped if self._cache is not None else 0

    @classmethod
    def from_prompts(
        cls,
        train: list[TokenizedPrompt],
        eval_set: list[TokenizedPrompt],
        cfg: DataConfig,
        tokenizer: Any,
        seed: int,
    ) -> PromptSource:
        """A source over prompts already in memory (tokenised, held-out split done): the same
        per-step draws as one built from a file holding ``train``."""
        if not train:
            raise ValueError("PromptSource.from_prompts: no training prompts")
        src = cls.__new__(cls)
        src.cfg, src.tokenizer, src.seed = cfg, tokenizer, seed
        src.task = open_task(cfg, seed)
        src._cache = RowCache.of(train)
        src._index = array("l", range(len(train)))
        src._eval, src._held_out, src._usable = list(eval_set), None, None
        src._orders = OrderedDict()
        return src

    def for_step(self, step: int, n: int) -> list[TokenizedPrompt]:
        """Step ``step``'s ``n`` training prompts (module docstring): a pure function of (seed,
        step, n)."""
        if self._cache is None:
            if not isinstance(self.task, GeneratedTask):
                raise ValueError("this PromptSource was built with_train=False")
            # Held-out problems never appear in training: draw extra and filter them out.
            if self._held_out is None:
                self._held_out = {p.record.prompt for p in self.eval_set()}
            held_out = self._held_out
            candidates = self.task.step_records(step, 4 * n + 16)
            return self._tokenize([r for r in candidates if r.prompt not in held_out][:n])[0]
        # epochs over the file, each a seeded shuffle (module docstring)
        assert self._index is not None
        index, rows = self._index, len(self._index)
        start = step * n
        picked = []
        for pos in range(start, start + n):
            epoch, i = divmod(pos, rows)
            picked.append(index[self._order(epoch)[i]])
        out = self._cache.get(picked)
        for j, p in enumerate(out):
            if p is None:
                out[j] = self._redraw(start + j)
        return out  # type: ignore[return-value]

    def _redraw(self, pos: int) -> TokenizedPrompt:
        """The replacement for an over-long prompt at stream position ``pos`` (module
        docstring): ``MAX_REDRAWS`` random rows, then a random one of the usable rows."""
        assert self._cache is not None and self._index is not None
        rng = random.Random(f"relayrl.redraw:{self.seed}:{pos}")
        index = self._index
        for _ in range(MAX_REDRAWS):
            p = self._cache.get([index[rng.randrange(len(index))]])[0]
            if p is not None:
                return p
        usable = self._usable_rows()
        p = self._cache.get([usable[rng.randrange(len(usable))]])[0]
        assert p is not None
        return p

    def _usable_rows(self) -> list[int]:
        """The training rows that are usable, tokenising the whole file once; none is a
        ``DataError`` saying why."""
        if self._usable is None:
            assert self._cache is not None and self._index is not None
            usable = set(self._cache.scan_all())
            self._usable = [i for i in self._index if i in usable]
            if not self._usable:
                raise DataError(self._cache.report.why_none(self.task_name))
        return self._usable

    def _order(self, epoch: int) -> array:
        """``epoch_order`` for this file, built once per epoch (LRU of ``EPOCH_CACHE``)."""
        order = self._orders.get(epoch)
        if order is None:
            assert self._index is not None
            order = self._orders[epoch] = epoch_order(self.seed, epoch, len(self._index))
            while len(self._orders) > EPOCH_CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order

    @property
    def task_name(self) -> str:
        """The training prompts' name in messages: the file, or the generated task."""
        return self.task.where if isinstance(self.task, DatasetTask) else self.task.name

    @property
    def eval_name(self) -> str:
        """The eval set's name in messages: ``data.eval_path``, or the task's held-out set."""
        if self.cfg.eval_path is not None:
            return self.cfg.eval_path
        if isinstance(self.task, GeneratedTask):
            return self.task.eval_name
        return f"the eval set held out of {self.task.where}"

    def _tokenize(
        self, records: Sequence[PromptRecord]
    ) -> tuple[list[TokenizedPrompt], SkipReport]:
        """``tokenize_prompts`` with this run's length limit and ``data.source`` template."""
        src = self.cfg.source
        return tokenize_prompts(
            records,
            self.tokenizer,
            self.cfg.max_prompt_tokens,
            src.chat_template,
            src.system_prompt,
        )

    def eval_set(self) -> list[TokenizedPrompt]:
        """The fixed held-out eval set (read and tokenised on first use)."""
        if self._eval is None:
            self._eval = self._load_eval()
        return self._eval

    def _load_eval(self) -> list[TokenizedPrompt]:
        records: Sequence[PromptRecord]
        if self.cfg.eval_path is not None:
            records = read_rows(self.cfg.source, self.cfg.eval_path)[: self.cfg.eval_size]
        elif isinstance(self.task, GeneratedTask):
            records = self.task.eval_records(self.cfg.eval_size)
        else:
            raise ValueError(f"data.eval_path is required when data.task is {self.cfg.task!r}")
        kept, report = self._tokenize(records)
        if not kept:
            raise DataError(report.why_none(self.eval_name))
        return kept

    def prompt_lengths(self, sample_steps: int = 1, per_step: int = 64) -> dict[str, list[int]]:
        """Token counts of the kept prompts, per source (``data.train_path`` and the eval set;
        for a training file of over ``PRETOKENIZE`` rows the ones tokenised so far, those drawn
        first; for the arithmetic task the first ``sample_steps`` steps' draws): what the context
        length check in ``relayrl.controller.preflight`` looks at."""
        out: dict[str, list[int]] = {}
        if self._cache is not None and self._index is not None:
            # the training prompts tokenised so far: all of a small file, else the first
            # PRETOKENIZE drawn (a sample: the rest are tokenised as they are drawn)
            lengths = [len(p.ids) for p in self._cache.tokenized()]
            name = self.task_name
            if self._cache.seen < len(self._cache):
                name += f" (the first {len(lengths)} prompts drawn, of {len(self._cache)} rows)"
            out[name] = lengths
        elif isinstance(self.task, GeneratedTask):
            out[self.task.name] = [
                len(p.ids) for s in range(sample_steps) for p in self.for_step(s, per_step)
            ]
        out[self.eval_name] = [len(p.ids) for p in self.eval_set()]
        return out

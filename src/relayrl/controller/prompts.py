"""Where each step's prompts come from, deterministically from (seed, step).

Being a pure function of the step keeps resume exact: a resumed run draws the same prompts a
straight run would, with no sampler state to save. For a training file, the prompt stream is
epochs over the file, epoch ``e`` the order ``random.Random(seed * 1_000_003 + e).shuffle``
gives; step ``s`` of ``n`` prompts takes stream positions ``s * n .. s * n + n - 1``. Each
epoch's permutation is built once (O(rows)) and kept (the last ``EPOCH_CACHE`` epochs), so a
step costs O(n) amortised, whatever the file's size.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.config import ArithmeticConfig, DataConfig
from relayrl.data import ArithmeticTask, DataError, PromptRecord, SkipReport, load_prompt_dataset
from relayrl.data import tokenize_prompts as _tokenize


@dataclass
class TokenizedPrompt:
    record: PromptRecord
    ids: list[int]

    def fields(self) -> dict[str, Any]:
        """Sample fields handed to the reward function."""
        return {**self.record.extra, "prompt": self.record.prompt, "answer": self.record.answer}


def arithmetic_task(a: ArithmeticConfig, seed: int) -> ArithmeticTask:
    """The built-in arithmetic task with the config's operand range, operators and count."""
    return ArithmeticTask(
        seed=seed,
        min_operand=a.min_operand,
        max_operand=a.max_operand,
        operators=tuple(a.operators),
        num_operands=a.num_operands,
    )


def tokenize_prompts(
    records: Sequence[PromptRecord], tokenizer: Any, max_tokens: int, cfg: DataConfig | None = None
) -> tuple[list[TokenizedPrompt], int]:
    """Tokenise once (token in, token out), through the tokenizer's chat template when it has
    one (``data.source.chat_template``); prompts over ``max_tokens`` are skipped and counted."""
    kept, report = tokenize_with_report(records, tokenizer, max_tokens, cfg)
    return kept, report.skipped


def tokenize_with_report(
    records: Sequence[PromptRecord], tokenizer: Any, max_tokens: int, cfg: DataConfig | None = None
) -> tuple[list[TokenizedPrompt], SkipReport]:
    """``tokenize_prompts`` with the whole ``SkipReport`` (why prompts were dropped)."""
    src = cfg.source if cfg is not None else None
    kept, report = _tokenize(
        records,
        tokenizer,
        max_tokens,
        use_chat_template=src.chat_template if src is not None else True,
        system_prompt=src.system_prompt if src is not None else None,
    )
    return [TokenizedPrompt(rec, ids) for rec, ids in kept], report


def _load(cfg: DataConfig, path: str) -> list[PromptRecord]:
    """JSONL, Parquet or a saved Hugging Face dataset (``relayrl.data.load_prompt_dataset``)."""
    s = cfg.source
    return load_prompt_dataset(
        path,
        prompt_key=s.prompt_key,
        answer_key=s.answer_key,
        require_answer=s.require_answer,
        split=s.split,
    )


def hold_out(
    train: list[TokenizedPrompt], cfg: DataConfig, seed: int
) -> tuple[list[TokenizedPrompt], list[TokenizedPrompt]]:
    """``data.eval_size`` distinct prompts of the training file, drawn with the run's seed,
    as the eval set (in file order); every row with a held-out prompt leaves training
    (duplicates too), so the evaluation is on prompts never trained on. At most half of
    the distinct prompts are held out: more is an error naming both keys."""
    n = cfg.eval_size
    distinct = list(dict.fromkeys(p.record.prompt for p in train))
    if len(distinct) < 2 * n:
        raise ValueError(
            f"{cfg.train_path}: {len(distinct)} distinct usable prompts; holding out "
            f"data.eval_size={n} for the evaluation would leave {len(distinct) - n} to train "
            "on: set data.eval_path or a smaller data.eval_size"
        )
    chosen = set(random.Random(f"relayrl.hold_out:{seed}").sample(distinct, n))
    held: dict[str, TokenizedPrompt] = {}
    for p in train:
        if p.record.prompt in chosen:
            held.setdefault(p.record.prompt, p)
    return [p for p in train if p.record.prompt not in chosen], list(held.values())


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
    held out of it (``task: jsonl`` without ``data.eval_path``: ``hold_out``). A file whose every
    prompt is dropped is a ``DataError`` saying why (``SkipReport.why_none``).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, seed: int, with_train: bool = True):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.skipped = 0
        self._train: list[TokenizedPrompt] | None = None
        self._eval: list[TokenizedPrompt] | None = None
        self._held_out: set[str] | None = None
        self._orders: OrderedDict[int, array] = OrderedDict()
        if cfg.task == "jsonl" and (with_train or cfg.eval_path is None):
            if cfg.train_path is None:
                raise ValueError("data.train_path is required when data.task is 'jsonl'")
            self._train, report = tokenize_with_report(
                _load(cfg, cfg.train_path), tokenizer, cfg.max_prompt_tokens, cfg
            )
            self.skipped = report.skipped
            if not self._train:
                raise DataError(report.why_none(cfg.train_path))
            if cfg.eval_path is None:
                self._train, self._eval = hold_out(self._train, cfg, seed)

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
        src.cfg, src.tokenizer, src.seed, src.skipped = cfg, tokenizer, seed, 0
        src._train, src._eval, src._held_out = list(train), list(eval_set), None
        src._orders = OrderedDict()
        return src

    def for_step(self, step: int, n: int) -> list[TokenizedPrompt]:
        if self._train is None and self.cfg.task == "jsonl":
            raise ValueError("this PromptSource was built with_train=False")
        if self._train is None:
            # Held-out problems never appear in training: draw extra and filter them out.
            if self._held_out is None:
                self._held_out = {p.record.prompt for p in self.eval_set()}
            held_out = self._held_out
            task = arithmetic_task(
                self.cfg.arithmetic, seed=self.seed * 1_000_003 + 7919 * (step + 1)
            )
            records = [r for r in task.sample(4 * n + 16) if r.prompt not in held_out][:n]
            kept, _ = tokenize_prompts(
                records, self.tokenizer, self.cfg.max_prompt_tokens, self.cfg
            )
            return kept
        # epochs over the file, each a seeded shuffle (module docstring)
        out: list[TokenizedPrompt] = []
        start = step * n
        for pos in range(start, start + n):
            epoch, i = divmod(pos, len(self._train))
            out.append(self._train[self._order(epoch)[i]])
        return out

    def _order(self, epoch: int) -> array:
        """``epoch_order`` for this file, built once per epoch (LRU of ``EPOCH_CACHE``)."""
        order = self._orders.get(epoch)
        if order is None:
            assert self._train is not None
            order = self._orders[epoch] = epoch_order(self.seed, epoch, len(self._train))
            while len(self._orders) > EPOCH_CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order

    def eval_set(self) -> list[TokenizedPrompt]:
        if self._eval is None:
            self._eval = self._load_eval()
        return self._eval

    def _load_eval(self) -> list[TokenizedPrompt]:
        if self.cfg.eval_path is not None:
            records = _load(self.cfg, self.cfg.eval_path)[: self.cfg.eval_size]
        elif self.cfg.task == "arithmetic":
            records = arithmetic_task(self.cfg.arithmetic, seed=self.seed).held_out(
                self.cfg.eval_size, seed=self.seed
            )
        else:
            raise ValueError("data.eval_path is required when data.task is 'jsonl'")
        kept, report = tokenize_with_report(
            records, self.tokenizer, self.cfg.max_prompt_tokens, self.cfg
        )
        if not kept:
            raise DataError(report.why_none(self.cfg.eval_path or "the arithmetic eval set"))
        return kept

    def prompt_lengths(self, sample_steps: int = 1, per_step: int = 64) -> dict[str, list[int]]:
        """Token counts of the kept prompts, per source (``data.train_path`` and the eval set;
        for the arithmetic task the first ``sample_steps`` steps' draws): what the context
        length check in ``relayrl.controller.preflight`` looks at."""
        out: dict[str, list[int]] = {}
        if self._train is not None:
            out[str(self.cfg.train_path)] = [len(p.ids) for p in self._train]
        elif self.cfg.task == "arithmetic":
            out["the arithmetic task"] = [
                len(p.ids) for s in range(sample_steps) for p in self.for_step(s, per_step)
            ]
        out[self.cfg.eval_path or "the arithmetic eval set"] = [len(p.ids) for p in self.eval_set()]
        return out

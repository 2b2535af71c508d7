"""Where a run's prompts come from: ``data.task`` names the source, and ``open_task`` is the one
function that reads the name.

A source is one of two kinds:

- ``DatasetTask``: fixed rows (``task: jsonl``: the file at ``data.train_path``, read by
  ``relayrl.data.prompts.read.load_prompts`` with ``data.source``'s keys). The eval set is
  ``data.eval_path``, or held out of the rows (``relayrl.data.prompts.hold_out``).
- ``GeneratedTask``: prompts made from the run's seed (``task: arithmetic``):
  ``step_records(step, k)`` is ``k`` candidates for step ``step`` (a pure function of (seed,
  step)); the draw drops held-out ones and keeps the first it needs. ``eval_records(n)`` is the
  task's own held-out stream (used unless ``data.eval_path`` is set).

A new source (a dataset read another way, another generator) is one more branch of
``open_task`` (and its name in ``DataConfig.task``); ``PromptSource`` needs nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relayrl.data.arithmetic import ArithmeticTask
from relayrl.data.prompts.read import PromptRows, load_prompts
from relayrl.data.records import PromptRecord

if TYPE_CHECKING:
    from relayrl.config import ArithmeticConfig, DataConfig, PromptSourceConfig

__all__ = [
    "DatasetTask",
    "GeneratedTask",
    "PromptTask",
    "arithmetic_task",
    "open_task",
    "read_rows",
]


@dataclass(frozen=True)
class DatasetTask:
    """Fixed rows: ``rows()`` reads and checks them (called once, only when they are needed);
    ``where`` names them in messages (the file's path)."""

    where: str
    rows: Callable[[], PromptRows]


@dataclass(frozen=True)
class GeneratedTask:
    """Prompts generated from a seed: ``step_records(step, k)``, ``eval_records(n)`` (module
    docstring); ``name`` and ``eval_name`` name the two streams in messages."""

    name: str
    eval_name: str
    step_records: Callable[[int, int], list[PromptRecord]]
    eval_records: Callable[[int], list[PromptRecord]]


PromptTask = DatasetTask | GeneratedTask


def arithmetic_task(a: ArithmeticConfig, seed: int) -> ArithmeticTask:
    """The built-in arithmetic task with the config's operand range, operators and count."""
    return ArithmeticTask(
        seed=seed,
        min_operand=a.min_operand,
        max_operand=a.max_operand,
        operators=tuple(a.operators),
        num_operands=a.num_operands,
    )


def read_rows(src: PromptSourceConfig, path: str) -> PromptRows:
    """The dataset at ``path`` read with the ``data.source`` keys (``prompt_key``,
    ``answer_key``, ``require_answer``, ``split``)."""
    return load_prompts(
        path,
        prompt_key=src.prompt_key,
        answer_key=src.answer_key,
        require_answer=src.require_answer,
        split=src.split,
    )


def open_task(cfg: DataConfig, seed: int) -> PromptTask:
    """The prompt source ``data.task`` names, for a run seeded ``seed``. Reads nothing yet.

    - ``jsonl``: the rows of ``data.train_path`` (``ValueError`` when they are asked for and it
      is unset);
    - ``arithmetic``: step ``s`` draws from ``ArithmeticTask`` seeded
      ``seed * 1_000_003 + 7919 * (s + 1)``; the eval set is its held-out stream for ``seed``.
    """
    if cfg.task == "jsonl":
        path = cfg.train_path

        def rows() -> PromptRows:
            if path is None:
                raise ValueError("data.train_path is required when data.task is 'jsonl'")
            return read_rows(cfg.source, path)

        return DatasetTask(str(path), rows)
    if cfg.task == "arithmetic":
        a = cfg.arithmetic
        return GeneratedTask(
            name="the arithmetic task",
            eval_name="the arithmetic eval set",
            step_records=lambda step, k: arithmetic_task(
                a, seed=seed * 1_000_003 + 7919 * (step + 1)
            ).sample(k),
            eval_records=lambda n: arithmetic_task(a, seed=seed).held_out(n, seed=seed),
        )
    raise ValueError(f"unknown data.task {cfg.task!r}")

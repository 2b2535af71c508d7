"""``reasoning_gym:<task>`` prompts: procedural problems from ``reasoning-gym``, generated offline
from a seed, each with what the task's own scorer needs.

Each problem becomes a ``PromptRecord`` with ``prompt`` = the task's question, ``answer`` = its
reference answer, and in ``extra``: ``rg_task`` (the task name, which picks the scorer),
``rg_metadata`` (the entry's metadata as plain JSON: tuples become lists) and ``domain``
(``reasoning_gym:<task>``, for per-domain reward statistics). The reward is
``reward.fn: reasoning_gym`` (``relayrl.reward.reasoning_gym_reward``): the answer parsed out
of the completion's free text, scored by ``reasoning_gym``'s ``score_answer``.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.data.jsonl import DataError
from relayrl.data.records import PromptRecord

__all__ = ["DEFAULT_SIZE", "reasoning_gym_records"]

DEFAULT_SIZE = 1000
"""Problems generated when the spec gives no ``size``."""


def _plain(value: Any) -> Any:
    """``value`` as JSON data (what a run directory can store and a worker can unpickle)."""
    return json.loads(json.dumps(value, default=str))


def reasoning_gym_records(task: str, params: dict[str, Any], spec: str) -> list[PromptRecord]:
    """``size`` problems of ``task`` with ``seed`` (defaults ``DEFAULT_SIZE``, 0) and the rest of
    ``params`` as the task's config; an unknown task or key is a one-line ``DataError``."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:  # pragma: no cover - the lock installs it
        raise DataError(f"{spec}: reasoning-gym is not installed ({exc}); run make") from None
    if task not in DATASETS:
        near = sorted(n for n in DATASETS if task[:4] in n)[:8] or sorted(DATASETS)[:8]
        raise DataError(f"{spec}: unknown reasoning_gym task {task!r} (e.g. {', '.join(near)})")
    kwargs = dict(params)
    size = kwargs.pop("size", DEFAULT_SIZE)
    seed = kwargs.pop("seed", 0)
    if not isinstance(size, int) or size < 1:
        raise DataError(f"{spec}: size must be a positive integer, got {size!r}")
    if not isinstance(seed, int):
        raise DataError(f"{spec}: seed must be an integer, got {seed!r}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{spec}: reasoning_gym rejects the config: {first}") from None
    domain = f"reasoning_gym:{task}"
    return [
        PromptRecord(
            prompt=entry["question"],
            answer=str(entry["answer"]),
            extra={"rg_task": task, "rg_metadata": _plain(entry["metadata"]), "domain": domain},
        )
        for entry in dataset
    ]

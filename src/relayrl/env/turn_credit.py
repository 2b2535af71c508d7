"""Per-turn advantages of a step's samples (``algo.turn_credit: stepwise_grpo``).

Each sample's turns come from ``metadata["env"]["turn_spans"]`` (the episode runner records
where each assistant turn of the trained segment sits in ``response_ids``) and their rewards
from ``metadata["env"]["turn_step_rewards"]`` (the environment's reward of each turn but the
last, None as 0); the last turn's reward is the sample's score. A sample without turns (a
single-turn run, an agent rollout, an earlier segment of a prefix-broken episode) is one turn
spanning its whole response. The math: :mod:`relayrl.algos.turn_credit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relayrl.algos.turn_credit import (
    discounted_turn_returns,
    spread_over_turns,
    stepwise_group_advantages,
)
from relayrl.rollout.types import Sample


def _turns(sample: Sample, score: float) -> tuple[list[float], list[tuple[int, int]]]:
    env = sample.metadata.get("env") or {}
    spans = [tuple(s) for s in env.get("turn_spans") or []]
    if not spans:
        return [score], [(0, len(sample.response_ids))]
    step_rewards = list(env.get("turn_step_rewards") or [])[: len(spans) - 1]
    step_rewards += [None] * (len(spans) - 1 - len(step_rewards))
    return [float(r or 0.0) for r in step_rewards] + [score], spans  # type: ignore[misc]


def turn_advantages(
    samples: Sequence[Sample],
    scores: Tensor,
    response_mask: Tensor,
    group_index: Sequence[int],
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """Token advantages ``[B, R]`` of step-wise GRPO over turns (see module)."""
    turns = [_turns(s, float(v)) for s, v in zip(samples, scores.tolist(), strict=True)]
    returns = [discounted_turn_returns(r, gamma) for r, _ in turns]
    adv = stepwise_group_advantages(returns, list(group_index), eps)
    width = response_mask.shape[1]
    rows = [spread_over_turns(a, spans, width) for a, (_, spans) in zip(adv, turns, strict=True)]
    out = torch.tensor(rows, dtype=torch.float32).reshape(len(rows), width)
    return out * response_mask.to(out.dtype)

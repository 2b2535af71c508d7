"""Reward role: decode completions and score them with a reward function.

Scores here are the raw verifiable outcome (the contract for filters and pass rates); shaping
and KL penalties are applied by the algorithm afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.reward import score
from relayrl.rollout.types import Sample


class RewardWorker:
    def __init__(self, fn: Callable[..., Any], tokenizer: Any):
        self.fn = fn
        self.tokenizer = tokenizer

    def decode(self, sample: Sample) -> str:
        return self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)

    def score(self, samples: Sequence[Sample]) -> tuple[Tensor, dict[str, float]]:
        """Score each sample (its ``metadata`` holds prompt, answer and extra fields).

        Returns the per-sample scores [B] and batch means of every named component.
        """
        scores = torch.zeros(len(samples), dtype=torch.float32)
        comp_sums: dict[str, float] = {}
        for i, s in enumerate(samples):
            fields = dict(s.metadata)
            out = score(self.fn, str(fields.get("prompt", "")), self.decode(s), fields)
            scores[i] = out["score"]
            for k, v in out.items():
                comp_sums[k] = comp_sums.get(k, 0.0) + float(v)
        n = max(len(samples), 1)
        return scores, {f"reward/{k}": v / n for k, v in comp_sums.items()}

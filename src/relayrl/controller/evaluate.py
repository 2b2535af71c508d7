"""Greedy held-out evaluation: pass rate of the current policy."""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.controller.prompts import TokenizedPrompt
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.workers.reward import RewardWorker


def greedy_pass_rate(
    engine: RolloutEngine,
    reward: RewardWorker,
    prompts: Sequence[TokenizedPrompt],
    max_tokens: int,
    stop_token_ids: list[int] | None = None,
) -> dict[str, float]:
    """Fraction of prompts whose greedy completion scores >= 1 (a verified correct answer)."""
    params = SamplingParams(greedy=True, max_tokens=max_tokens, stop_token_ids=stop_token_ids or [])
    requests = [GenerationRequest(p.ids, params, metadata=p.fields()) for p in prompts]
    samples = engine.generate(requests)
    scores, _ = reward.score(samples)
    outcomes = reward.outcomes(samples, scores)
    return {
        "eval/pass_rate": float((outcomes >= 1.0).float().mean()),
        "eval/reward_mean": float(scores.mean()),
        "eval/n": float(len(samples)),
    }

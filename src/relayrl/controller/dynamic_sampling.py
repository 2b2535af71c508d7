"""DAPO dynamic sampling for the sync schedule: keep the groups whose outcomes differ, refill.

``SyncSchedule.rollout`` calls :func:`dynamic_rollout` in place of one generate-and-score
when ``data.dynamic_sampling.enabled``; the async schedules filter groups as they finish
(``controller.rollout_controller``, with :func:`group_outcomes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.config import RunConfig
from relayrl.controller.algorithms import make_requests, rollout_and_score
from relayrl.controller.failures import infra_cause
from relayrl.data import dynamic_sample
from relayrl.data.prompts import TokenizedPrompt
from relayrl.rollout import Sample
from relayrl.workers import Roles


def group_outcomes(group: Sequence[tuple[Sample, float]]) -> list[float]:
    """The raw outcomes of a scored group (before reward mixing): what dynamic sampling
    tests for variance. Infrastructure failures are no outcome (``controller.failures``)."""
    return [
        float(s.metadata.get("reward", {}).get("outcome", v))
        for s, v in group
        if infra_cause(s) is None
    ]


REFILL_STEP_BASE = 10_000_000


def refill_prompts(
    source: Any, step: int, max_rounds: int
) -> Callable[[int, int], Sequence[TokenizedPrompt]]:
    """Prompts for dynamic-sampling round r >= 1 of ``step``: ``source.for_step`` at step
    indices no training step uses, so refills are fresh and resume-exact."""
    return lambda rnd, n: source.for_step(REFILL_STEP_BASE + step * max_rounds + rnd, n)


def dynamic_rollout(
    roles: Roles,
    prompts: Sequence[TokenizedPrompt],
    cfg: RunConfig,
    step: int,
    stop_ids: list[int],
    timer: dict[str, float],
    refill: Callable[[int, int], Sequence[TokenizedPrompt]] | None,
) -> tuple[list[Sample], Tensor, dict[str, float]]:
    """DAPO dynamic sampling: keep groups whose raw verifiable outcomes differ, refill until
    ``prompts_per_step`` groups or ``max_rounds`` rounds; log ``dynamic/dropped_frac``.

    The outcome of a sample is the reward service's raw ``outcome`` when recorded, else its
    score. Kept groups are renumbered 0..B-1. If no group is kept, round 0's groups are used
    (all-zero advantages: the update only moves the KL and entropy terms).
    """
    timer["time/generate"] = timer["time/score"] = 0.0
    first: dict[str, Any] = {}

    def generate(rnd: int, n: int) -> list[list[tuple[Sample, float]]]:
        batch = list(prompts) if rnd == 0 else list(refill(rnd, n) if refill else [])
        if not batch:
            return []
        sub: dict[str, float] = {}
        samples, scores, stats = rollout_and_score(
            roles, make_requests(batch, cfg, step, stop_ids), sub, cfg.failures.retries
        )
        timer["failures/retried"] = timer.get("failures/retried", 0.0)
        timer["failures/retried"] += sub.get("failures/retried", 0.0)
        timer["time/generate"] += sub["time/generate"]
        timer["time/score"] += sub["time/score"]
        groups: dict[Any, list[tuple[Sample, float]]] = {}
        for sample, value in zip(samples, scores.tolist(), strict=True):
            groups.setdefault(sample.group_id, []).append((sample, value))
        if rnd == 0:
            first.update(stats=stats, groups=list(groups.values()), scores=scores)
        return list(groups.values())

    kept, ds = dynamic_sample(
        generate, group_outcomes, len(prompts), cfg.data.dynamic_sampling.max_rounds
    )
    if not kept:
        kept = first.get("groups", [])
    samples, values = [], []
    for new_id, group in enumerate(kept):
        for sample, value in group:
            sample.group_id = new_id
            samples.append(sample)
            values.append(value)
    stats = dict(first.get("stats", {}))
    stats.update(ds.as_metrics())
    if "scores" in first:
        stats["dynamic/raw_pass_rate"] = float((first["scores"] >= 1.0).float().mean())
    return samples, torch.tensor(values, dtype=torch.float32), stats

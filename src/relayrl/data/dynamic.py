"""DAPO dynamic sampling: drop groups that teach nothing, refill until the batch is full.

A GRPO group whose samples all got the same verifiable outcome (all right or all wrong) has
zero advantage everywhere: it costs a training step and contributes no gradient. Dynamic
sampling (Yu et al. 2025, DAPO, eq. 11) over-samples and keeps only groups with
0 < #correct < G, here: groups whose *raw* outcomes (never shaped or normalised scores: a
contract of docs/architecture.md) are not all equal. It keeps generating rounds until
``target`` groups are kept or ``max_rounds`` rounds were drawn, and reports the dropped
fraction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["DynamicSamplingStats", "dynamic_sample", "has_signal"]

G = TypeVar("G")


def has_signal(outcomes: Sequence[float], tol: float = 1e-9) -> bool:
    """True when the outcomes of one group are not all equal (non-zero variance)."""
    values = [float(x) for x in outcomes]
    return len(values) > 1 and max(values) - min(values) > tol


@dataclass
class DynamicSamplingStats(Generic[G]):
    """What one dynamically sampled batch cost."""

    rounds: int = 0
    groups_seen: int = 0
    groups_kept: int = 0
    groups_dropped: int = 0
    filled: bool = False

    @property
    def dropped_frac(self) -> float:
        return self.groups_dropped / self.groups_seen if self.groups_seen else 0.0

    def as_metrics(self, prefix: str = "dynamic/") -> dict[str, float]:
        return {
            f"{prefix}dropped_frac": self.dropped_frac,
            f"{prefix}rounds": float(self.rounds),
            f"{prefix}groups_seen": float(self.groups_seen),
            f"{prefix}groups_kept": float(self.groups_kept),
            f"{prefix}filled": float(self.filled),
        }


def dynamic_sample(
    generate: Callable[[int, int], Sequence[G]],
    outcomes: Callable[[G], Sequence[float]],
    target: int,
    max_rounds: int = 4,
    tol: float = 1e-9,
) -> tuple[list[G], DynamicSamplingStats]:
    """Keep groups with signal until ``target`` are kept or ``max_rounds`` rounds are used.

    Args:
        generate: ``generate(round, n)`` rolls out and scores ``n`` new groups (round 0 is
            the normal batch of ``target``; later rounds must draw different prompts and ask
            for the missing groups divided by the observed keep rate, at most ``target``).
        outcomes: the raw verifiable outcomes of a group's samples.
        target: groups wanted.
        max_rounds: cap on rounds (>= 1).

    Returns the kept groups (at most ``target``, in generation order; fewer when the cap was
    hit) and the stats. Groups past ``target`` in the last round are discarded unseen.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    kept: list[G] = []
    stats: DynamicSamplingStats = DynamicSamplingStats()
    while len(kept) < target and stats.rounds < max_rounds:
        if stats.rounds == 0:
            need = target
        else:  # over-draw by the observed keep rate (at least 1/5) to need fewer rounds
            rate = max(len(kept) / max(stats.groups_seen, 1), 0.2)
            need = min(target, math.ceil((target - len(kept)) / rate))
        groups = generate(stats.rounds, need)
        stats.rounds += 1
        for g in groups:
            if len(kept) >= target:
                break
            stats.groups_seen += 1
            if has_signal(outcomes(g), tol):
                kept.append(g)
            else:
                stats.groups_dropped += 1
    stats.groups_kept = len(kept)
    stats.filled = len(kept) >= target
    return kept, stats

"""Accuracy curves of ``bench/peer_trl_smollm2.py``: held-out accuracy against training time,
the common target accuracy and each arm's time to reach it (pure functions, no model).

A curve is a list of points ``(step, wall_s, cpu_s, acc)``: the held-out greedy accuracy of the
model after ``step`` training steps, with the wall and CPU seconds of training steps 0..step-1
summed (the per-step figures the bench measures; evaluation, checkpointing, model loading and
start-up are not training time). Step 0 is the base model, at 0 seconds.
"""

from __future__ import annotations

import statistics
from typing import Any

Point = tuple[int, float, float, float]
"""(step, train wall seconds so far, train CPU seconds so far, held-out accuracy)."""

EPS = 1e-9
"""Accuracies are fractions k / n: a reached target is ``acc >= target - EPS``."""


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps evaluated: 0, K, 2K, ... and ``steps`` (always); K = 0 or K >= N: 0 and N."""
    if every <= 0 or every >= steps:
        return [0, steps]
    return sorted({*range(0, steps, every), steps})


def curve(steps: list[int], step_times: list[float], cpu_times: list[float],
          accs: dict[int, float]) -> list[Point]:  # fmt: skip
    """Points at ``steps`` (those with an accuracy): wall_s = sum(step_times[:step]),
    cpu_s = sum(cpu_times[:step]) (missing times count 0), rounded to 0.01 s."""
    return [
        (
            s,
            round(float(sum(step_times[:s])), 2),
            round(float(sum(cpu_times[:s])), 2),
            round(accs[s], 4),
        )
        for s in steps
        if s in accs
    ]


def common_target(curves: dict[str, list[Point]], target: float | None = None) -> float | None:
    """``target`` when given; else the highest accuracy every arm reached: min over arms of the
    arm's best accuracy (None without curves)."""
    if target is not None:
        return target
    best = [max(p[3] for p in c) for c in curves.values() if c]
    return min(best) if best and len(best) == len(curves) else None


def time_to_target(points: list[Point], target: float) -> dict[str, Any] | None:
    """The first point with ``acc >= target``: its step, wall and CPU seconds; None if never."""
    for step, wall, cpu, acc in points:
        if acc >= target - EPS:
            return {"step": step, "wall_s": wall, "cpu_s": cpu, "acc": acc}
    return None


def _over(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x is not None and y else None


def target_summary(curves: dict[str, list[Point]], target: float | None = None,
                   ref: str = "trl") -> dict[str, Any]:  # fmt: skip
    """The target (``common_target``), each arm's ``time_to_target``, ``target_at_base`` (every
    arm reached it at step 0) and, for every other arm, its wall and CPU seconds to the target
    over ``ref``'s (None where either is missing or the reference's time is 0, e.g. the base
    model already at the target)."""
    t = common_target(curves, target)
    out: dict[str, Any] = {"target": t, "target_given": target is not None}
    if t is None:
        return out
    reach = {arm: time_to_target(c, t) for arm, c in curves.items()}
    out["to_target"] = reach
    # every arm at the target before training (no arm got past the base): times 0, no ratio
    out["target_at_base"] = all(r is not None and r["step"] == 0 for r in reach.values())
    base = reach.get(ref)
    for arm, r in reach.items():
        if arm == ref or base is None or r is None:
            continue
        out[f"wall_to_target_{arm}_over_{ref}"] = _over(r["wall_s"], base["wall_s"])
        out[f"cpu_to_target_{arm}_over_{ref}"] = _over(r["cpu_s"], base["cpu_s"])
    return out


def across_seeds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over seeds of every ``*_over_*`` ratio of the per-seed summary lines (the seeds
    with a figure), with how many seeds gave one."""
    keys = sorted({k for s in summaries for k in s if "_over_" in k})
    out: dict[str, Any] = {}
    for k in keys:
        xs = [s[k] for s in summaries if isinstance(s.get(k), (int, float))]
        out[k] = round(statistics.median(xs), 3) if xs else None
        out[f"{k}_n"] = len(xs)
    return out

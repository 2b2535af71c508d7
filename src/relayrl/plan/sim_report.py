"""What a simulation reports: :class:`SimResult`, the utilisation figures computed from the
slot-occupancy timeline, the steady-state throughput, and text helpers.

Utilisation: the simulator logs ``(time, +1/-1)`` whenever a slot is taken or freed; between
two such instants the number of running sequences is constant. Over a window ``[lo, hi]``:

    slot utilisation = integral(running dt) / (reference * (hi - lo))
    low share        = time with running < 0.1 * reference / (hi - lo)

with ``reference = min(slots, B)`` for batch schedules (their windows are each batch's
generation, first admission to last finish) and all slots for ``async`` (one window, the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SimResult", "Occupancy", "sparkline", "speedup", "steady_rate"]


@dataclass
class SimResult:
    """What one simulation measured (times in seconds)."""

    config: dict[str, Any]
    makespan_s: float
    samples: int
    response_tokens: int
    samples_per_s: float
    tokens_per_s: float
    steady_samples_per_s: float
    step_end_times: list[float]
    breakdown: dict[str, float]
    slots: int
    reference_slots: int
    slot_utilisation: float
    low_utilisation_share: float
    utilisation_timeline: list[tuple[float, float]]
    staleness_hist: dict[int, int]
    max_staleness: int
    mean_staleness: float
    interrupted_fraction: float
    decode_steps: int
    events: list[dict[str, Any]] = field(default_factory=list)
    samples_log: list[dict[str, Any]] = field(default_factory=list)

    def staleness_quantile(self, q: float) -> int:
        """Token-weighted ``q``-quantile of staleness."""
        total = sum(self.staleness_hist.values())
        if total == 0:
            return 0
        acc = 0
        for s in sorted(self.staleness_hist):
            acc += self.staleness_hist[s]
            if acc >= q * total:
                return s
        return max(self.staleness_hist)

    def summary(self) -> dict[str, Any]:
        """Flat, JSON-friendly figures (no timelines)."""
        return {
            "schedule": self.config["schedule"],
            "eta": self.config["eta"],
            "interrupt": self.config["interrupt"],
            "makespan_s": round(self.makespan_s, 4),
            "samples_per_s": round(self.samples_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "steady_samples_per_s": round(self.steady_samples_per_s, 4),
            **{k: round(v, 4) for k, v in self.breakdown.items()},
            "slot_utilisation": round(self.slot_utilisation, 4),
            "low_utilisation_share": round(self.low_utilisation_share, 4),
            "mean_staleness": round(self.mean_staleness, 4),
            "max_staleness": self.max_staleness,
            "p99_staleness": self.staleness_quantile(0.99),
            "interrupted_fraction": round(self.interrupted_fraction, 4),
        }


class Occupancy:
    """Running sequences over time from ``(time, +1/-1)`` deltas, cut at ``end``."""

    def __init__(self, deltas: list[tuple[float, int]], end: float, reference: int) -> None:
        self.ref = reference
        self.end = end
        times = [0.0]
        levels = [0]
        run = 0
        for tt, d in sorted(deltas):
            run += d
            if tt > end:
                break
            if tt == times[-1]:
                levels[-1] = run
            else:
                times.append(tt)
                levels.append(run)
        times.append(end)
        self.times = times
        self.levels = levels

    def integrate(self, lo: float, hi: float) -> tuple[float, float, float]:
        """``(integral of running dt, time below 10% of the reference, time with any running)``
        over ``[lo, hi]``."""
        area = low = busy = 0.0
        for i in range(len(self.levels)):
            a, b = max(self.times[i], lo), min(self.times[i + 1], hi)
            if b <= a:
                continue
            area += self.levels[i] * (b - a)
            if self.levels[i] < 0.1 * self.ref:
                low += b - a
            if self.levels[i] > 0:
                busy += b - a
        return area, low, busy

    def over(self, windows: list[tuple[float, float]]) -> tuple[float, float]:
        """``(slot utilisation, low share)`` over the union of ``windows``."""
        area = low = span = 0.0
        for lo, hi in windows:
            a_, l_, _ = self.integrate(lo, hi)
            area, low, span = area + a_, low + l_, span + (hi - lo)
        if span <= 0:
            return 0.0, 0.0
        return area / (self.ref * span), low / span

    def timeline(self, bins: int = 40) -> list[tuple[float, float]]:
        """``bins`` equal slices of ``[0, end]``: (start, utilisation)."""
        out = []
        for j in range(bins):
            lo, hi = self.end * j / bins, self.end * (j + 1) / bins
            a_, _, _ = self.integrate(lo, hi)
            out.append((lo, a_ / (self.ref * (hi - lo)) if hi > lo else 0.0))
        return out


def steady_rate(step_end: list[float], batch: int) -> float:
    """Samples/s over the second half of the steps: ``(n - h) * B / (t_n - t_h)`` with
    ``h = n // 2``; the whole run ``n * B / t_n`` when there is no second half."""
    n = len(step_end)
    half = n // 2
    if half >= 1 and n - half >= 1 and step_end[-1] > step_end[half - 1]:
        return (n - half) * batch / (step_end[-1] - step_end[half - 1])
    return n * batch / step_end[-1] if step_end and step_end[-1] > 0 else 0.0


def speedup(a: SimResult, b: SimResult, steady: bool = True) -> float:
    """Throughput of ``a`` over ``b`` (samples/s ratio; steady-state by default)."""
    if steady:
        return a.steady_samples_per_s / b.steady_samples_per_s
    return a.samples_per_s / b.samples_per_s


_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """Render fractions in [0, 1] as a bar string like the lecture's utilisation strip."""
    out = []
    for v in values:
        v = min(1.0, max(0.0, v))
        out.append(_BARS[min(len(_BARS) - 1, int(round(v * (len(_BARS) - 1))))])
    return "".join(out)

"""Environment latency per turn of a multi-turn episode (agent workloads), in seconds.

An agent episode alternates generating and waiting: turn 1 is generated, the environment
(a tool call, a test run, a browser step) takes ``w_1`` seconds and returns observation
tokens, turn 2 is generated, ... A ``turns``-turn episode waits ``turns - 1`` times (no wait
after the final answer). The simulator draws the waits from one of these distributions:

* :class:`LognormalLatency` - heavy-tailed: ``w = median * exp(sigma * Z)``, ``Z ~ N(0, 1)``,
  with ``sigma = ln(p99 / median) / z_0.99`` (``z_0.99 = 2.3263``) so that the median and the
  99th percentile are the given ones; optionally capped at ``cap_s`` (a tool timeout).
  Mean ``median * exp(sigma^2 / 2)``: median 1 s, p99 30 s gives sigma 1.462, mean 2.91 s.
* :class:`EmpiricalLatency` - resample measured latencies (a list, or a file with one number
  per line / a JSON list).
* :class:`ConstantLatency` - every wait the same.
* :class:`FixedLatency` - a given sequence, in order (cycled), for hand-worked examples.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "Z99",
    "ConstantLatency",
    "EmpiricalLatency",
    "FixedLatency",
    "LatencyDist",
    "LognormalLatency",
    "parse_latency",
]

Z99 = 2.3263478740408408
"""Standard normal 0.99 quantile."""


class LatencyDist(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` waits in seconds (float64, >= 0)."""
        ...


@dataclass(frozen=True)
class LognormalLatency:
    """Lognormal waits by median and 99th percentile (seconds), optionally capped."""

    median_s: float
    p99_s: float
    cap_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.median_s > 0 and self.p99_s >= self.median_s):
            raise ValueError(
                f"lognormal latency needs median_s > 0 and p99_s >= median_s, got "
                f"median_s={self.median_s}, p99_s={self.p99_s}"
            )
        if self.cap_s is not None and self.cap_s <= 0:
            raise ValueError(f"lognormal latency cap_s must be > 0, got {self.cap_s}")

    @property
    def sigma(self) -> float:
        """``ln(p99 / median) / z_0.99``."""
        return math.log(self.p99_s / self.median_s) / Z99

    @property
    def mean_s(self) -> float:
        """Uncapped mean ``median * exp(sigma^2 / 2)``."""
        return self.median_s * math.exp(self.sigma**2 / 2)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        w = self.median_s * np.exp(self.sigma * rng.standard_normal(n))
        return np.minimum(w, self.cap_s) if self.cap_s is not None else w


@dataclass(frozen=True)
class ConstantLatency:
    """Every wait ``seconds``."""

    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"constant latency must be >= 0 s, got {self.seconds}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, float(self.seconds))


@dataclass
class FixedLatency:
    """The given waits in order, cycled (hand-worked examples)."""

    seconds: list[float]
    _pos: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.seconds or min(self.seconds) < 0:
            raise ValueError("fixed latency must be a non-empty list of seconds >= 0")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        out = [self.seconds[(self._pos + j) % len(self.seconds)] for j in range(n)]
        self._pos += n
        return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class EmpiricalLatency:
    """Resample measured waits (seconds) uniformly."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples or min(self.samples) < 0:
            raise ValueError("empirical latency needs a non-empty list of seconds >= 0")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.choice(np.asarray(self.samples, dtype=np.float64), size=n, replace=True)

    @classmethod
    def from_file(cls, path: str | Path) -> EmpiricalLatency:
        """A JSON list of seconds, or one number per line."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"latency file not found: {p}")
        text = p.read_text().strip()
        try:
            if text.startswith("["):
                vals = [float(x) for x in json.loads(text)]
            else:
                vals = [float(x) for x in text.split()]
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{p}: not a list of seconds ({exc})") from None
        return cls(tuple(vals))


def parse_latency(spec: str) -> LatencyDist:
    """CLI form: ``lognormal:MEDIAN_S:P99_S[:CAP_S]``, ``constant:S``, ``samples:S,S,...``
    (resampled), ``fixed:S,S,...`` (in order) or ``file:PATH``."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "lognormal" and len(parts) in (2, 3):
            cap = float(parts[2]) if len(parts) == 3 else None
            return LognormalLatency(float(parts[0]), float(parts[1]), cap)
        if kind == "constant" and len(parts) == 1:
            return ConstantLatency(float(parts[0]))
        if kind == "samples" and len(parts) == 1:
            return EmpiricalLatency(tuple(float(x) for x in parts[0].split(",")))
        if kind == "fixed" and len(parts) == 1:
            return FixedLatency([float(x) for x in parts[0].split(",")])
        if kind == "file" and rest:
            return EmpiricalLatency.from_file(rest)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad env latency spec {spec!r}: {exc}") from None
    raise ValueError(
        f"bad env latency spec {spec!r}; use lognormal:MEDIAN_S:P99_S[:CAP_S], constant:S, "
        "samples:S,S,..., fixed:S,S,... or file:PATH"
    )

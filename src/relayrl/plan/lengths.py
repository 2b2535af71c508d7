"""Response-length distributions for the simulator (all lengths in tokens, integers >= 1).

* :class:`LognormalLengths` - ``L = clip(round(median * exp(sigma * Z)), min_len, cap)`` with
  ``Z ~ N(0, 1)``. Before the cap the mean is ``median * exp(sigma^2 / 2)``, so sigma = 0.74
  turns a median of 968 into a mean of 1274; the cap truncates the tail (many answers stop at
  the cap once ``sigma`` is large).
* :class:`EmpiricalLengths` - resample observed lengths (a list, or a histogram of bin edges
  and counts, uniform within a bin), e.g. read from a run's logs with :meth:`from_file`.
* :class:`ConstantLengths` - every answer the same length.
* :class:`FixedLengths` - a given sequence, in order (cycled), for hand-worked examples.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "ConstantLengths",
    "EmpiricalLengths",
    "FixedLengths",
    "LengthDist",
    "LognormalLengths",
    "parse_lengths",
]


class LengthDist(Protocol):
    @property
    def cap(self) -> int:
        """The longest length ``sample`` can return."""
        ...

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths as an int64 array."""
        ...


@dataclass(frozen=True)
class LognormalLengths:
    """Lognormal lengths by median and sigma, capped (see module docstring)."""

    median: float
    sigma: float
    cap: int
    min_len: int = 1

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or self.cap < 1 or self.min_len < 1:
            raise ValueError("lognormal lengths need median > 0, sigma >= 0, cap >= 1, min >= 1")
        if self.min_len > self.cap:
            raise ValueError("lognormal lengths: min_len must be <= cap")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        z = rng.standard_normal(n)
        raw = np.rint(self.median * np.exp(self.sigma * z))
        return np.clip(raw, self.min_len, self.cap).astype(np.int64)

    @property
    def uncapped_mean(self) -> float:
        """``median * exp(sigma^2 / 2)``."""
        return self.median * math.exp(self.sigma**2 / 2)

    @staticmethod
    def sigma_for_mean(median: float, mean: float) -> float:
        """Sigma with the given uncapped mean: ``sqrt(2 ln(mean / median))``."""
        if mean < median or median <= 0:
            raise ValueError("a lognormal's mean is >= its median")
        return math.sqrt(2 * math.log(mean / median))


@dataclass(frozen=True)
class ConstantLengths:
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError("constant length must be >= 1")

    @property
    def cap(self) -> int:  # type: ignore[override]
        return self.length

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.length, dtype=np.int64)


@dataclass
class FixedLengths:
    """Deterministic lengths, in the given order, cycled."""

    lengths: list[int]
    _pos: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("fixed lengths must be a non-empty list of integers >= 1")

    @property
    def cap(self) -> int:  # type: ignore[override]
        return max(self.lengths)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        out = [self.lengths[(self._pos + j) % len(self.lengths)] for j in range(n)]
        self._pos += n
        return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True)
class EmpiricalLengths:
    """Resample observed lengths, or draw from a histogram (``edges``, ``counts``)."""

    values: tuple[int, ...] = ()
    edges: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.values:
            if min(self.values) < 1:
                raise ValueError("empirical lengths must be >= 1")
        elif self.edges:
            if len(self.edges) != len(self.counts) + 1 or sum(self.counts) <= 0:
                raise ValueError("histogram needs len(edges) == len(counts) + 1 and counts > 0")
            if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
                raise ValueError("histogram edges must increase")
        else:
            raise ValueError("empirical lengths need values or a histogram")

    @property
    def cap(self) -> int:  # type: ignore[override]
        return int(max(self.values)) if self.values else int(math.ceil(self.edges[-1]))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.values:
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=n, replace=True)
        p = np.asarray(self.counts, dtype=float)
        p = p / p.sum()
        idx = rng.choice(len(p), size=n, p=p)
        lo = np.asarray(self.edges[:-1])[idx]
        hi = np.asarray(self.edges[1:])[idx]
        return np.maximum(1, np.rint(lo + rng.random(n) * (hi - lo))).astype(np.int64)

    @classmethod
    def from_file(cls, path: str | Path, key: str | None = None) -> EmpiricalLengths:
        """Lengths from a JSON list, a JSON histogram ``{"edges": [...], "counts": [...]}``,
        or JSONL rows carrying a length field (``key``, else the first of ``response_length``,
        ``response_len``, ``length``, ``num_tokens``; a list value counts each element)."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"length file not found: {p}")
        text = p.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            return cls(values=tuple(int(v) for v in data))
        if isinstance(data, dict) and "edges" in data:
            return cls(edges=tuple(data["edges"]), counts=tuple(data["counts"]))
        keys = [key] if key else ["response_length", "response_len", "length", "num_tokens"]
        vals: list[int] = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{p}:{i}: not JSON") from None
            for k in keys:
                if isinstance(row, dict) and k in row:
                    v = row[k]
                    vals.extend(int(x) for x in (v if isinstance(v, list) else [v]))
                    break
        if not vals:
            raise ValueError(f"{p}: no length field ({', '.join(keys)}) found")
        return cls(values=tuple(vals))


def parse_lengths(spec: str) -> LengthDist:
    """CLI form: ``lognormal:MEDIAN:SIGMA:CAP``, ``constant:N``, ``fixed:N,N,...``,
    or ``empirical:PATH``."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "lognormal" and len(parts) == 3:
            return LognormalLengths(float(parts[0]), float(parts[1]), int(parts[2]))
        if kind == "constant" and len(parts) == 1:
            return ConstantLengths(int(parts[0]))
        if kind == "fixed" and len(parts) == 1:
            return FixedLengths([int(x) for x in parts[0].split(",")])
        if kind == "empirical" and rest:
            return EmpiricalLengths.from_file(rest)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad length spec {spec!r}: {exc}") from None
    raise ValueError(
        f"bad length spec {spec!r}; use lognormal:MEDIAN:SIGMA:CAP, constant:N, fixed:N,N,... "
        "or empirical:PATH"
    )

"""Weighted mixing of reward functions, per-domain z-score normalisation, and batch logging.

A mixture is a list of ``RewardSpec`` (function by name or ``module:function``, weight,
keyword arguments, component name). For one sample it calls every function, and returns a
``ScoreResult``:

- ``score`` = sum_k w_k * s_k (the mixed reward, before any batch normalisation);
- ``components``: each function's raw score under its name, and any extra components it
  returned under ``name/key``;
- ``outcome``: the raw score of the *outcome* component (the first function unless named):
  the verifiable result that pass rates, difficulty filters and dynamic sampling look at;
- ``error``: why a component failed (it raised, returned a non-number, or the call timed
  out); a failed component scores ``failure_score``, the others still count;
- ``reason``: reasons the functions gave (e.g. a sandbox timeout), joined.

``zscore_by_domain`` normalises mixed scores within a batch, per domain:
z_i = (s_i - mean_d) / (std_d + eps), with d the domain of sample i.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from relayrl.reward.functions import RewardFn, RewardSpecError, evaluate, get_reward_fn

__all__ = [
    "RewardMix",
    "RewardSpec",
    "ScoreResult",
    "batch_reward_stats",
    "zscore_by_domain",
]


@dataclass(frozen=True)
class RewardSpec:
    """One component of a mixture.

    Args:
        fn: a registered name (``"math"``) or an import path ``"pkg.module:function"``.
        weight: its weight in the mixed score.
        kwargs: keyword arguments bound to the function (``overlong``'s lengths, ...).
        name: the component's name in logs (default: the function name).
    """

    fn: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str | None = None

    @property
    def component(self) -> str:
        return self.name or self.fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


@dataclass
class ScoreResult:
    """The score of one sample (see the module docstring)."""

    score: float
    components: dict[str, float]
    outcome: float
    error: str | None = None
    reason: str | None = None
    latency_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failure(
        cls,
        error: str,
        failure_score: float = 0.0,
        latency_s: float = 0.0,
    ) -> ScoreResult:
        """Every component failed (timeout, crashed worker, undecodable sample ...)."""
        return cls(failure_score, {"score": failure_score}, failure_score, error, None, latency_s)


def _as_spec(item: Any) -> RewardSpec:
    if isinstance(item, RewardSpec):
        return item
    if isinstance(item, str):
        return RewardSpec(item)
    if isinstance(item, Mapping):
        unknown = set(item) - {"fn", "weight", "kwargs", "name"}
        if unknown or "fn" not in item:
            raise RewardSpecError(
                f"reward spec {dict(item)!r}: expected keys fn, weight, kwargs, name"
            )
        return RewardSpec(
            str(item["fn"]),
            float(item.get("weight", 1.0)),
            dict(item.get("kwargs") or {}),
            item.get("name"),
        )
    if hasattr(item, "fn") and hasattr(item, "weight"):  # a config object
        return RewardSpec(
            item.fn,
            float(item.weight),
            dict(getattr(item, "kwargs", {}) or {}),
            getattr(item, "name", None),
        )
    raise RewardSpecError(f"cannot read a reward spec from {item!r}")


def _bind(spec: RewardSpec) -> RewardFn:
    fn = get_reward_fn(spec.fn)
    kwargs = dict(spec.kwargs)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind("prompt", "completion", {}, **kwargs)
        except TypeError as e:
            raise RewardSpecError(f"reward function {spec.fn!r} with kwargs {kwargs}: {e}") from e
    return functools.partial(fn, **kwargs) if kwargs else fn


class RewardMix:
    """A picklable weighted mixture of reward functions (see the module docstring).

    Args:
        specs: ``RewardSpec``s, names / import paths, or ``{fn, weight, kwargs, name}`` dicts.
        outcome: name of the component that is the verifiable outcome (default the first).
        failure_score: the score of a failed component (and of a failed sample).

    The functions are resolved at construction (so a bad spec is an error at start-up,
    naming it) and again, lazily, in each process that unpickles the mixture.
    """

    def __init__(
        self,
        specs: Sequence[Any] | str | RewardSpec,
        outcome: str | None = None,
        failure_score: float = 0.0,
    ) -> None:
        if isinstance(specs, (str, RewardSpec, Mapping)):
            specs = [specs]
        self.specs: list[RewardSpec] = [_as_spec(s) for s in specs]
        if not self.specs:
            raise RewardSpecError("a reward mixture needs at least one function")
        names = [s.component for s in self.specs]
        if len(set(names)) != len(names):
            raise RewardSpecError(f"duplicate reward component names {names}: set 'name'")
        for s in self.specs:
            if not math.isfinite(s.weight):
                raise RewardSpecError(f"reward {s.component!r}: weight must be finite")
        if outcome is not None and outcome not in names:
            raise RewardSpecError(f"outcome component {outcome!r} is not one of {names}")
        self.outcome = outcome or names[0]
        self.failure_score = float(failure_score)
        self._fns: list[RewardFn] | None = None
        self.resolve()

    @classmethod
    def from_fn(
        cls,
        fn: RewardFn,
        name: str | None = None,
        failure_score: float = 0.0,
    ) -> RewardMix:
        """A one-function mixture around a callable (it must be picklable for a pool)."""
        mix = cls.__new__(cls)
        comp = name or getattr(fn, "__name__", None) or "fn"
        mix.specs = [RewardSpec(f"<callable {comp}>", 1.0, {}, comp)]
        mix.outcome = comp
        mix.failure_score = float(failure_score)
        mix._fns = [fn]
        mix._callable = fn  # type: ignore[attr-defined]
        return mix

    def resolve(self) -> list[RewardFn]:
        """The bound functions (imports them on first use in this process)."""
        if self._fns is None:
            self._fns = [_bind(s) for s in self.specs]
        return self._fns

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if "_callable" not in state:
            state["_fns"] = None  # re-resolved by name in the receiving process
        return state

    @property
    def names(self) -> list[str]:
        return [s.component for s in self.specs]

    def __call__(self, prompt: str, completion: str, sample: dict) -> ScoreResult:
        """Score one sample; never raises (failures are recorded in the result)."""
        t0 = time.perf_counter()
        try:
            fns = self.resolve()
        except Exception as e:
            return ScoreResult.failure(f"{type(e).__name__}: {e}", self.failure_score)
        total = 0.0
        components: dict[str, float] = {}
        errors: list[str] = []
        reasons: list[str] = []
        outcome = self.failure_score
        for spec, fn in zip(self.specs, fns, strict=True):
            name = spec.component
            try:
                out, reason = evaluate(fn, prompt, completion, sample)
                value = out["score"]
                for key, v in out.items():
                    if key != "score":
                        components[f"{name}/{key}"] = v
                if reason:
                    reasons.append(f"{name}: {reason}")
            except Exception as e:  # a reward function bug must not crash the run
                value = self.failure_score
                errors.append(f"{name}: {type(e).__name__}: {e}"[:500])
            components[name] = value
            total += spec.weight * value
            if name == self.outcome:
                outcome = value
        components["score"] = total
        return ScoreResult(
            total,
            components,
            outcome,
            "; ".join(errors) or None,
            "; ".join(reasons) or None,
            time.perf_counter() - t0,
        )


def zscore_by_domain(
    values: Sequence[float], domains: Sequence[Any] | None = None, eps: float = 1e-6
) -> list[float]:
    """z_i = (x_i - mean_d) / (std_d + eps) within each domain d (population std).

    Without ``domains`` the whole batch is one domain. A domain with a single sample, or
    with all-equal values, maps to 0.
    """
    n = len(values)
    if domains is None:
        domains = [None] * n
    if len(domains) != n:
        raise ValueError(f"zscore_by_domain: {n} values but {len(domains)} domains")
    groups: dict[Any, list[int]] = {}
    for i, d in enumerate(domains):
        groups.setdefault(d, []).append(i)
    out = [0.0] * n
    for idx in groups.values():
        xs = [float(values[i]) for i in idx]
        mean = math.fsum(xs) / len(xs)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
        for i, x in zip(idx, xs, strict=True):
            out[i] = (x - mean) / (std + eps)
    return out


def batch_reward_stats(
    results: Sequence[ScoreResult], domains: Sequence[Any] | None = None, prefix: str = "reward/"
) -> dict[str, float]:
    """Batch means to log: every component, the outcome, the failure rate, per-domain means.

    Keys: ``reward/<component>`` (``reward/score`` is the mixed score), ``reward/outcome``,
    ``reward/failed_frac``, ``reward/latency_s``, and ``reward/domain/<d>/score`` when
    domains are given.
    """
    n = len(results)
    if n == 0:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r.components.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    stats = {f"{prefix}{k}": sums[k] / counts[k] for k in sums}
    stats[f"{prefix}outcome"] = math.fsum(r.outcome for r in results) / n
    stats[f"{prefix}failed_frac"] = sum(r.failed for r in results) / n
    stats[f"{prefix}latency_s"] = math.fsum(r.latency_s for r in results) / n
    if domains is not None:
        per: dict[Any, list[float]] = {}
        for r, d in zip(results, domains, strict=True):
            per.setdefault(d, []).append(r.score)
        for d, xs in per.items():
            stats[f"{prefix}domain/{d}/score"] = math.fsum(xs) / len(xs)
    return stats

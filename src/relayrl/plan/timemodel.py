"""Time models: how long a decode step, a prefill and a training pass take.

Two implementations share one small interface (:class:`TimeModel`):

* :class:`RooflineTimeModel` - a GPU from its spec sheet. For ``g`` devices holding one
  replica (tensor parallel, weights split ``g`` ways) and a batch of ``n`` sequences whose
  cached contexts total ``C`` tokens:

      decode step   t = overhead + max((W + kv * C) / (g * BW * e_dec),   # bytes read
                                       2 * N * n     / (g * P  * mfu))    # FLOPs
      prefill       t = 2 * N * tokens / (g * P * mfu)
      training      t = f * N * tokens / (g * P * mfu)       (f = 6: forward 2 + backward 4)

  with ``W`` weight bytes, ``kv`` KV bytes per token, ``BW`` HBM bandwidth (B/s), ``P`` peak
  FLOP/s, ``e_dec`` the fraction of bandwidth decoding achieves (0.6 by default) and ``mfu``
  the model-FLOPs utilisation (0.4). Concurrency per replica is capped by KV memory:
  ``floor((g * HBM * frac - W) / (kv * max_context))``.

* :class:`ProfiledTimeModel` - a machine measured by :func:`relayrl.plan.profiling.profile`
  (decode step time at a few batch sizes, its slope in cached context, prefill and training
  tokens/s). Times scale as ``threads_measured / devices`` when a run gives a role fewer
  cores than the profile used (ideal scaling, an approximation).

Every decode step time has the form ``max(A + beta * C, G)`` for a fixed batch ``n`` (``A``,
``G`` in seconds, ``beta`` in seconds per cached token); :func:`steps_time` sums ``k`` such steps
in closed form while ``C`` grows by ``n`` tokens per step, which lets the simulator jump
between events instead of stepping token by token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from relayrl.plan.hardware import HardwareSpec
from relayrl.plan.models import ModelSpec

__all__ = [
    "DoesNotFit",
    "FixedStepTimeModel",
    "MeasuredProfile",
    "ProfiledTimeModel",
    "RooflineTimeModel",
    "TimeModel",
    "steps_time",
    "steps_within",
]


class DoesNotFit(ValueError):
    """A role's memory exceeds its devices (the message names what it would need)."""


class TimeModel(Protocol):
    """What the simulator asks of a time model (all times in seconds)."""

    @property
    def weight_bytes(self) -> float: ...

    def decode_step_params(self, batch: int, devices: int) -> tuple[float, float, float]:
        """``(A, beta, G)``: one step of ``batch`` sequences costs ``max(A + beta*C, G)``."""
        ...

    def prefill_time(self, tokens: float, devices: int) -> float: ...

    def train_time(self, tokens: float, devices: int) -> float: ...

    def max_concurrency(self, devices: int, max_context: int) -> int: ...


def steps_time(a: float, beta: float, g: float, n: int, c0: float, k: int) -> float:
    """Seconds for ``k`` decode steps of ``n`` sequences starting with ``c0`` cached tokens.

    Step ``s`` (0-based) reads ``C_s = c0 + n*s`` tokens and costs ``max(A + beta*C_s, G)``.
    The memory term grows with ``s``; the compute term is flat, so the sum splits at the first
    step ``m`` where memory wins:  ``G*m + (k-m)*(A + beta*c0) + beta*n*(k(k-1) - m(m-1))/2``.
    """
    if k <= 0:
        return 0.0
    base = a + beta * c0
    if base >= g:
        m = 0
    else:
        x = (g - base) / (beta * n) if beta * n > 0 else math.inf
        m = k if not math.isfinite(x) or x >= k else math.ceil(x)
    tri = (k * (k - 1) - m * (m - 1)) / 2.0
    return g * m + (k - m) * base + beta * n * tri


def steps_within(
    a: float, beta: float, g: float, n: int, c0: float, budget: float, k_max: int
) -> int:
    """Smallest ``k <= k_max`` whose :func:`steps_time` is ``>= budget`` (``k_max`` if none).

    Used to find the first step boundary at or after a wall-clock instant.
    """
    if budget <= 0:
        return 0
    lo, hi = 0, k_max
    if steps_time(a, beta, g, n, c0, hi) < budget:
        return k_max
    while lo < hi:
        mid = (lo + hi) // 2
        if steps_time(a, beta, g, n, c0, mid) >= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class RooflineTimeModel:
    """Spec-sheet time model of ``model`` on ``hardware`` (formulas in the module docstring).

    Attributes:
        decode_efficiency: fraction of HBM bandwidth a decode step achieves (``e_dec``).
        mfu: model-FLOPs utilisation of prefill and training.
        train_flops_per_param_token: ``f`` (6 for one forward+backward; add 2 per extra
            forward pass such as recomputing old logprobs, 6 per extra trained model of the
            same size).
        step_overhead_s: fixed cost per decode step (kernel launches, sampling).
        kv_memory_fraction: share of HBM usable for weights + KV cache.
        max_batch_per_device: optional cap on running sequences per device.
    """

    model: ModelSpec
    hardware: HardwareSpec
    decode_efficiency: float = 0.6
    mfu: float = 0.4
    train_flops_per_param_token: float = 6.0
    step_overhead_s: float = 0.0
    kv_memory_fraction: float = 0.9
    max_batch_per_device: int | None = None

    def __post_init__(self) -> None:
        for name in ("decode_efficiency", "mfu", "kv_memory_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")

    @property
    def weight_bytes(self) -> float:
        return self.model.weight_bytes

    def decode_step_params(self, batch: int, devices: int) -> tuple[float, float, float]:
        bw = devices * self.hardware.mem_bandwidth * self.decode_efficiency
        a = self.step_overhead_s + self.model.weight_bytes / bw
        beta = self.model.kv_bytes_per_token / bw
        g = self.step_overhead_s + (
            self.model.forward_flops_per_token()
            * batch
            / (devices * self.hardware.peak_flops * self.mfu)
        )
        return a, beta, g

    def decode_step_time(self, batch: int, context_tokens: float, devices: int = 1) -> float:
        """One step: ``max(A + beta * C, G)`` seconds (``C`` = cached tokens in the batch)."""
        a, beta, g = self.decode_step_params(batch, devices)
        return max(a + beta * context_tokens, g)

    def decode_tokens_per_s(self, batch: int, context_per_seq: float, devices: int = 1) -> float:
        """Tokens/s of one replica running ``batch`` sequences of ``context_per_seq`` tokens."""
        return batch / self.decode_step_time(batch, batch * context_per_seq, devices)

    def prefill_time(self, tokens: float, devices: int) -> float:
        return (
            self.model.forward_flops_per_token()
            * tokens
            / (devices * self.hardware.peak_flops * self.mfu)
        )

    def train_time(self, tokens: float, devices: int) -> float:
        return (
            self.train_flops_per_param_token
            * self.model.params
            * tokens
            / (devices * self.hardware.peak_flops * self.mfu)
        )

    def train_tokens_per_s(self, devices: int = 1) -> float:
        """``g * P * mfu / (f * N)`` tokens/s."""
        return 1.0 / self.train_time(1.0, devices)

    def check_trainer_fits(self, devices: int) -> None:
        """Refuse a trainer whose state does not fit: ``M = model.memory_bytes(trained=True)``
        (16 bytes per parameter: weights, gradients, fp32 master, Adam; activations left out)
        sharded over ``devices`` must fit ``kv_memory_fraction`` of each device's memory.
        70B: 1120 GB, at least 16 H100 (72 GB usable each)."""
        need = self.model.memory_bytes(True)
        usable = self.hardware.memory_bytes * self.kv_memory_fraction
        if need / devices > usable:
            raise DoesNotFit(
                f"the {self.model.name} trainer does not fit: {need / 1e9:.0f} GB of training "
                f"state (weights, gradients, Adam) is {need / devices / 1e9:.0f} GB per device "
                f"on {devices} x {self.hardware.name}, {usable / 1e9:.0f} GB usable; it needs "
                f"at least {math.ceil(need / usable)} training devices"
            )

    def max_concurrency(self, devices: int, max_context: int) -> int:
        budget = devices * self.hardware.memory_bytes * self.kv_memory_fraction
        budget -= self.model.weight_bytes
        if budget <= 0:
            raise ValueError(
                f"{self.model.name} weights ({self.model.weight_bytes / 1e9:.0f} GB) do not fit on "
                f"{devices} x {self.hardware.name}"
            )
        n = int(budget // (self.model.kv_bytes_per_token * max(1, max_context)))
        if self.max_batch_per_device is not None:
            n = min(n, self.max_batch_per_device * devices)
        if n < 1:
            raise ValueError(
                f"not one sequence of {max_context} tokens fits the KV memory of {devices} x "
                f"{self.hardware.name}"
            )
        return n


@dataclass
class FixedStepTimeModel:
    """Every decode step costs ``step_s`` whatever the batch; prefill/training cost per token.

    For hand-worked examples counted in steps (lecture 19, exercise 1).
    """

    step_s: float = 1.0
    prefill_s_per_token: float = 0.0
    train_s_per_token: float = 0.0
    concurrency: int = 100
    weight_bytes: float = 0.0
    prefill_overhead_s: float = 0.0
    """Fixed seconds of every prefill of at least one token (an engine step that admits)."""

    def decode_step_params(self, batch: int, devices: int) -> tuple[float, float, float]:
        return self.step_s, 0.0, 0.0

    def prefill_time(self, tokens: float, devices: int) -> float:
        """``(prefill_overhead_s + prefill_s_per_token * tokens) / devices``; 0 for none."""
        if tokens <= 0:
            return 0.0
        return (self.prefill_overhead_s + self.prefill_s_per_token * tokens) / devices

    def train_time(self, tokens: float, devices: int) -> float:
        return self.train_s_per_token * tokens / devices

    def max_concurrency(self, devices: int, max_context: int) -> int:
        return self.concurrency * devices


# The measurements a profile holds per thread count (``MeasuredProfile.at_threads``).
THREAD_MEASUREMENTS = (
    "decode_step_s",
    "decode_s_per_ctx_token",
    "prefill_tokens_per_s",
    "train_tokens_per_s",
)


@dataclass
class MeasuredProfile:
    """Speeds of one model measured on one machine (written by ``relayrl profile``).

    Attributes:
        model: model directory or name.
        params: parameter count.
        device: ``cpu`` (or ``cuda``).
        threads: torch threads used (the "devices" the measurement stands for).
        dtype: weights dtype during the measurement.
        decode_context: cached tokens per sequence at which decode steps were timed.
        decode_step_s: ``{batch: seconds per decode step}``.
        decode_s_per_ctx_token: extra seconds per step per cached token (slope in ``C``).
        prefill_tokens_per_s: forward tokens/s on full prompts.
        train_tokens_per_s: forward + backward + AdamW tokens/s.
        weight_bytes: bytes of the weights as held (for weight-transfer times).
        prefill_overhead_s: fixed seconds of one prefill (a step that admits sequences),
            whatever its tokens: a prefill of ``n`` tokens costs
            ``prefill_overhead_s + n / prefill_tokens_per_s``. 0 for a profile of bare
            forwards; an engine profile (``relayrl.rollout.timing``) measures it, and it
            dominates when multi-turn episodes come back from their environments one by one.
    """

    model: str
    params: float
    device: str
    threads: int
    dtype: str
    decode_context: int
    decode_step_s: dict[int, float]
    decode_s_per_ctx_token: float
    prefill_tokens_per_s: float
    train_tokens_per_s: float
    weight_bytes: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    at_threads: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The same measurements at other thread counts (``relayrl profile --also-threads``):
    ``{threads: {decode_step_s, decode_s_per_ctx_token, prefill_tokens_per_s,
    train_tokens_per_s}}``. CPU speed-ups are far from linear in threads (a small decode step
    is mostly per-forward overhead and gains little from a second thread, training more:
    docs/measurements.md), so a time model uses these where it can instead of scaling
    ``threads / devices``."""
    prefill_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        self.decode_step_s = {int(k): float(v) for k, v in self.decode_step_s.items()}
        self.at_threads = {
            int(t): {
                **m,
                "decode_step_s": {int(k): float(v) for k, v in m["decode_step_s"].items()},
            }
            for t, m in self.at_threads.items()
        }
        if not self.decode_step_s:
            raise ValueError("profile has no decode_step_s measurements")
        if min(self.decode_step_s.values()) <= 0:
            raise ValueError("profile decode_step_s must be > 0")
        if self.prefill_tokens_per_s <= 0 or self.train_tokens_per_s <= 0:
            raise ValueError("profile prefill_tokens_per_s and train_tokens_per_s must be > 0")
        if self.threads < 1:
            raise ValueError("profile threads must be >= 1")
        if self.prefill_overhead_s < 0:
            raise ValueError("profile prefill_overhead_s must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_step_s"] = {str(k): v for k, v in self.decode_step_s.items()}
        d["at_threads"] = {
            str(t): {**m, "decode_step_s": {str(k): v for k, v in m["decode_step_s"].items()}}
            for t, m in self.at_threads.items()
        }
        return d

    def with_threads(self, threads: int) -> MeasuredProfile | None:
        """This profile as measured at ``threads`` threads, or None if it was not."""
        if threads == self.threads:
            return self
        m = self.at_threads.get(threads)
        if m is None:
            return None
        return replace(self, threads=threads, at_threads={}, **m)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MeasuredProfile:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"profile file not found: {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not valid JSON ({exc.msg})") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeasuredProfile:
        names = set(cls.__dataclass_fields__)
        optional = {"extra", "weight_bytes", "at_threads", "prefill_overhead_s"}
        missing = [k for k in names - optional if k not in d]
        if missing:
            raise ValueError(f"profile lacks {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class ProfiledTimeModel:
    """Time model from a :class:`MeasuredProfile`.

    Decode step of ``n`` sequences with ``C`` cached tokens:
    ``f(n) + slope * (C - n * ctx_ref)`` where ``f`` interpolates the measured step times
    linearly in ``n`` (extrapolating the last segment) and ``ctx_ref`` is the context the
    profile measured at. All times are multiplied by ``threads / devices``, except on a CPU
    profile also measured at ``devices`` threads (``at_threads``): those are used as they are.

    Attributes:
        profile: the measurement.
        concurrency: running sequences per replica (the engine's slot count).
    """

    profile: MeasuredProfile
    concurrency: int = 32

    @property
    def weight_bytes(self) -> float:
        return self.profile.weight_bytes or self.profile.params * 4.0

    def _at(self, devices: int) -> tuple[MeasuredProfile, float]:
        """The measurement to use on ``devices`` and the factor its times are scaled by: the
        profile at that many threads when it was measured there (CPU), else the base
        profile scaled by ``threads / devices``."""
        if self.profile.device == "cpu":
            exact = self.profile.with_threads(devices)
            if exact is not None:
                return exact, 1.0
        return self.profile, self.profile.threads / max(devices, 1)

    def _f(self, profile: MeasuredProfile, n: int) -> float:
        pts = sorted(profile.decode_step_s.items())
        if len(pts) == 1:
            ((b0, t0),) = pts
            return t0 * max(n, 1) / b0 if n > b0 else t0
        if n <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
            if n <= b1:
                return t0 + (t1 - t0) * (n - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (n - b1)

    def decode_step_params(self, batch: int, devices: int) -> tuple[float, float, float]:
        p, s = self._at(devices)
        f = self._f(p, batch)
        slope = max(0.0, p.decode_s_per_ctx_token)
        a = max(f - slope * batch * p.decode_context, 0.2 * f)
        return a * s, slope * s, 0.0

    def prefill_time(self, tokens: float, devices: int) -> float:
        """``(prefill_overhead_s + tokens / prefill_tokens_per_s) * scale``; 0 for no tokens."""
        if tokens <= 0:
            return 0.0
        p, s = self._at(devices)
        return (p.prefill_overhead_s + tokens / p.prefill_tokens_per_s) * s

    def train_time(self, tokens: float, devices: int) -> float:
        p, s = self._at(devices)
        return tokens / p.train_tokens_per_s * s

    def max_concurrency(self, devices: int, max_context: int) -> int:
        return self.concurrency

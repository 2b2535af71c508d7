"""Masked reductions over response tokens.

Every tensor here is [B, T] over response tokens and ``response_mask`` may have holes.
A masked entry is replaced by ``torch.where`` *before* any arithmetic, so a NaN or inf
sitting in a masked slot never reaches a value or a gradient (multiplying by the mask
would turn ``0 * inf`` into NaN, in the forward or in the backward pass).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def as_bool_mask(response_mask: Tensor) -> Tensor:
    """Boolean view of a float/bool/int mask: a position counts iff its entry is non-zero."""
    if response_mask.dtype == torch.bool:
        return response_mask
    return response_mask != 0


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``where(mask, x, 0)``: drops masked entries (and any NaN/inf they hold) exactly."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_{m=1} x over ``dim`` (all dims when None); masked entries never contribute."""
    kept = zero_masked(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_count(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of unmasked entries, as a tensor of ``x``'s dtype (mask broadcast to x)."""
    m = torch.broadcast_to(as_bool_mask(mask), x.shape).to(x.dtype)
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_{m=1} x / n over ``dim``; an empty slice (n = 0) gives 0, never NaN."""
    n = masked_count(x, mask, dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the unmasked entries (all dims), sum (x - mean)^2 / (n - 1) when unbiased.

    With fewer than two entries (n <= 1, or n = 0 when biased) the variance is 0, not NaN.
    """
    m = as_bool_mask(mask)
    x = zero_masked(x, m)
    mean = masked_mean(x, m)
    centred = zero_masked(x - mean, m)
    n = masked_count(x, m)
    denom = n - 1 if unbiased else n
    return (centred**2).sum() / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over all unmasked entries (unbiased var); 0 where masked.

    The batch-level advantage whitening of PPO implementations (OpenAI baselines, veRL).
    With ``shift_mean=False`` the mean is added back: only the scale is normalised.
    """
    m = as_bool_mask(mask)
    x = zero_masked(x, m)  # first: a NaN in a masked slot would reach var's gradient
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked(whitened, m)


_DEFERRED = contextvars.ContextVar("relayrl_deferred_stats", default=False)


@contextlib.contextmanager
def deferred_stats() -> Iterator[None]:
    """Inside: ``stats_to_floats`` returns detached float64 0-dim tensors (on the device)
    instead of floats, so a caller that sums them converts once for a whole training step
    (no device -> host sync per micro-batch)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def stats_to_floats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Detach and convert scalar tensors to python floats with a single device sync (under
    ``deferred_stats``: detached float64 tensors, no sync; they add and multiply as floats)."""
    if not stats:
        return {}
    if _DEFERRED.get():
        return {k: v.detach().to(torch.float64) for k, v in stats.items()}  # type: ignore[misc]
    values = torch.stack([v.detach().to(torch.float64) for v in stats.values()]).tolist()
    return dict(zip(stats.keys(), values, strict=True))


def host_floats(values: dict[str, Any]) -> dict[str, float]:
    """``values`` (floats, or 0-d tensors on one device, e.g. what ``stats_to_floats`` returns
    under ``deferred_stats``, summed over a step) as floats: the tensors reach the host stacked,
    in one transfer; the floats never go to the device."""
    out = {k: v for k, v in values.items() if not isinstance(v, Tensor)}
    tensors = {k: v for k, v in values.items() if isinstance(v, Tensor)}
    if tensors:
        read = torch.stack([v.to(torch.float64).reshape(()) for v in tensors.values()]).tolist()
        out.update(zip(tensors, read, strict=True))
    return out

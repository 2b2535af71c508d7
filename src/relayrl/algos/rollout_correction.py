"""Rollout correction: the train / inference mismatch between the engine's and the trainer's
probabilities of the same tokens under the same weights.

An inference engine (other kernels, bf16, another sampler) does not sample from exactly the
distribution the trainer computes; with vLLM the gap is far beyond numerical noise and
training on it unweighted can collapse (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; Liu et al. 2025, "When speed kills stability").
With rho = pi_train(y) / pi_engine(y) per token (log rho = trainer - engine logprob), this
module computes a constant weight per token that multiplies the policy loss:

- ``tis`` (truncated IS, Yao et al.): w = min(rho, cap);
- ``mis`` (masked IS, Liu et al.): w = rho inside [lower, upper], else 0 (the token or
  sequence is dropped);
- ``icepop`` (Ling team 2025, IcePop, arXiv:2510.18855): token-level MIS, M(rho) = rho inside
  [lower, upper], 0 outside: both sides masked, nothing truncated;
- ``none``: w = 1 (only the monitor stats and the rejection below).

``level: token`` uses rho_t; ``level: sequence`` the sequence ratio prod_t rho_t (veRL's
``sequence``: unbiased, high variance), on each of its tokens. ``batch_normalize`` divides by
the mean weight of the step's kept tokens (sequence level: of its kept sequences), so the
mean is 1. ``reject_kl`` drops (w = 0) every sequence whose KL(engine || trainer) estimate,
aggregated over its tokens (``kl_agg`` mean / sum / max of k1 = -log rho, k2, k3), exceeds it.

A weight-0 token stays in the loss normaliser (AReaL's convention for its behaviour cap;
veRL removes rejected tokens from the response mask instead). Weights are computed once per
step on the whole batch, so they do not depend on micro-batching.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.masked import as_bool_mask, masked_mean, stats_to_floats, zero_masked

CORRECTION_MODES: tuple[str, ...] = ("none", "tis", "mis", "icepop")
LOG_RATIO_LIMIT = 20.0
RATIO_BINS: tuple[float, ...] = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)
"""Edges of the ratio histogram in the stats: rho < 0.5, [0.5, 0.8), ..., rho >= 2."""


def _sequence_kl(log_rho: Tensor, mask: Tensor, estimator: str, agg: str) -> Tensor:
    """Per-sequence KL(engine || trainer) estimate [B] from tokens sampled by the engine."""
    if estimator == "k1":
        k = -log_rho
    elif estimator == "k2":
        k = 0.5 * log_rho**2
    elif estimator == "k3":
        k = torch.exp(log_rho) - 1.0 - log_rho
    else:
        raise ValueError(f"unknown kl estimator {estimator!r}; known: ['k1', 'k2', 'k3']")
    if agg == "sum":
        return zero_masked(k, mask).sum(-1)
    if agg == "mean":
        return masked_mean(k, mask, dim=-1)
    if agg == "max":
        low = torch.full_like(k, -torch.inf)
        top = torch.where(mask, k, low).amax(-1) if k.shape[-1] else k.new_zeros(k.shape[0])
        return torch.where(mask.any(-1), top, torch.zeros_like(top))
    raise ValueError(f"unknown kl aggregation {agg!r}; known: ['mean', 'sum', 'max']")


def mismatch_stats(
    log_rho: Tensor, response_mask: Tensor, threshold: float = 0.1
) -> dict[str, Tensor]:
    """What the engine and the trainer disagree on, over valid tokens (tensor values).

    logp_diff_mean / logp_diff_abs_mean / logp_diff_abs_max of log rho = trainer - engine;
    beyond_threshold_frac = fraction with |log rho| > threshold; kl_k1 = mean(-log rho) and
    kl_k3 = mean(rho - 1 - log rho), estimates of KL(engine || trainer); ratio_frac_* the
    histogram of rho over ``RATIO_BINS``.
    """
    mask = as_bool_mask(response_mask)
    lr = zero_masked(log_rho, mask)
    rho = torch.exp(lr)
    dtype = lr.dtype
    out = {
        "logp_diff_mean": masked_mean(lr, mask),
        "logp_diff_abs_mean": masked_mean(lr.abs(), mask),
        "logp_diff_abs_max": lr.abs().amax() if lr.numel() else lr.new_zeros(()),
        "beyond_threshold_frac": masked_mean((lr.abs() > threshold).to(dtype), mask),
        "kl_k1": masked_mean(-lr, mask),
        "kl_k3": masked_mean(rho - 1.0 - lr, mask),
    }
    edges = (0.0, *RATIO_BINS, float("inf"))
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        name = f"lt_{hi:g}" if lo == 0.0 else (f"ge_{lo:g}" if hi == float("inf") else None)
        name = name or f"{lo:g}_{hi:g}"
        inside = (rho >= lo) & (rho < hi)
        out[f"ratio_frac_{name}"] = masked_mean(inside.to(dtype), mask)
    return out


def rollout_correction(
    trainer_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    response_mask: Tensor,
    mode: str = "none",
    level: str = "token",
    cap: float | None = 2.0,
    lower: float | None = 0.5,
    upper: float | None = 2.0,
    batch_normalize: bool = False,
    reject_kl: float | None = None,
    kl_estimator: str = "k3",
    kl_agg: str = "mean",
    mismatch_threshold: float = 0.1,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token rollout-correction weights [B, T] (0 in masked slots) and their stats.

    See the module docstring for the modes. ``cap=None`` (TIS) and ``lower=upper=None``
    (MIS / IcePop) leave rho untouched: the weight is then exactly rho. Stats, prefixed
    ``rollout_corr/``: the :func:`mismatch_stats`, weight_mean / weight_max of the final
    weights, affected_frac (valid tokens the mode truncated or masked), rejected_frac /
    rejected_seq_frac (tokens / non-empty sequences dropped by ``reject_kl``) and
    batch_norm_factor (the mean divided by; 1 without ``batch_normalize``).
    """
    if mode not in CORRECTION_MODES:
        known = list(CORRECTION_MODES)
        raise ValueError(f"unknown rollout correction mode {mode!r}; known: {known}")
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout correction level must be 'token' or 'sequence', got {level!r}")
    if mode == "icepop" and level != "token":
        raise ValueError("icepop masks tokens: it needs level 'token'")
    if lower is not None and upper is not None and not 0 < lower < upper:
        raise ValueError(f"need 0 < lower < upper, got lower={lower}, upper={upper}")
    mask = as_bool_mask(response_mask)
    if trainer_logprobs.shape != mask.shape or behaviour_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(trainer_logprobs.shape)} / {tuple(behaviour_logprobs.shape)} "
            f"!= response_mask {tuple(mask.shape)}"
        )
    log_rho = zero_masked(trainer_logprobs.detach(), mask) - zero_masked(
        behaviour_logprobs.detach(), mask
    )
    log_rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if level == "sequence":
        log_w = zero_masked(log_rho, mask).sum(-1, keepdim=True).expand_as(log_rho)
    else:
        log_w = log_rho
    rho = torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    ones = torch.ones_like(rho)
    if mode == "none":
        w = ones
    elif mode == "tis":
        w = rho if cap is None else rho.clamp(max=cap)
    else:  # mis, icepop
        inside = torch.ones_like(mask)
        if lower is not None:
            inside = inside & (rho >= lower)
        if upper is not None:
            inside = inside & (rho <= upper)
        w = torch.where(inside, rho, torch.zeros_like(rho))
    w = zero_masked(w, mask)
    affected = mask & (w != (ones if mode == "none" else rho))
    kept = mask & ~affected if mode != "tis" else mask.clone()
    rejected_seq = torch.zeros(mask.shape[0], dtype=torch.bool)
    if reject_kl is not None:
        seq_kl = _sequence_kl(log_rho, mask, kl_estimator, kl_agg)
        rejected_seq = mask.any(-1) & (seq_kl > reject_kl)
        w = torch.where(rejected_seq[:, None], torch.zeros_like(w), w)
        kept = kept & ~rejected_seq[:, None]
    factor = torch.ones((), dtype=w.dtype)
    if batch_normalize:
        if level == "sequence":
            rows = kept.any(-1)
            seq_w = w.amax(-1)  # one weight per sequence (>= 0), on all its tokens
            mean = seq_w[rows].mean() if bool(rows.any()) else factor
        else:
            mean = masked_mean(w, kept) if bool(kept.any()) else factor
        factor = mean if float(mean) > 1e-8 else torch.ones((), dtype=w.dtype)
        w = w / factor
    with torch.no_grad():
        dtype = w.dtype
        nonempty = mask.any(-1)
        stats = {
            **mismatch_stats(log_rho, mask, mismatch_threshold),
            "weight_mean": masked_mean(w, mask),
            "weight_max": w.amax() if w.numel() else w.new_zeros(()),
            "affected_frac": masked_mean(affected.to(dtype), mask),
            "rejected_frac": masked_mean((mask & rejected_seq[:, None]).to(dtype), mask),
            "rejected_seq_frac": (rejected_seq.to(dtype).sum() / nonempty.sum().clamp(min=1)),
            "batch_norm_factor": factor,
        }
    return w.detach(), {f"rollout_corr/{k}": v for k, v in stats_to_floats(stats).items()}

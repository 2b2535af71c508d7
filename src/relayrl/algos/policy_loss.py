"""Policy-gradient losses: PPO clip (+ dual clip) and AReaL's decoupled PPO objective.

Only ``logprobs`` carries gradient: anchor logprobs (old / proximal / behaviour) and
advantages are treated as constants and detached. Masked inputs are replaced before any
arithmetic, so garbage in a masked slot never reaches the loss or a gradient.
Stats are python floats, masked means over the given micro-batch; 0.0 for an empty mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm, aggregate_loss
from relayrl.algos.masked import as_bool_mask, masked_mean, stats_to_floats, zero_masked

# exp() of a log-ratio beyond +-20 is a broken sample, not a policy update: clamp it so the
# loss stays finite. Such a token is far outside any clip range, so only the unclipped
# branch of an A < 0 token without dual clip loses its gradient.
LOG_RATIO_LIMIT = 20.0


def _check_inputs(mask: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x.shape != mask.shape:
            raise ValueError(f"{name} {tuple(x.shape)} != response_mask {tuple(mask.shape)}")


def _check_clip(eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if not (0.0 <= eps_low <= 1.0) or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low <= 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds -A * ratio for A < 0), got {dual_clip}")


def _clipped_surrogate(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO-clip loss around ``anchor_logprobs`` and its tensor stats."""
    logp = zero_masked(logprobs, mask)
    anchor = zero_masked(anchor_logprobs.detach(), mask)
    adv = zero_masked(advantages.detach(), mask)
    log_ratio = logp - anchor
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        dual_active = mask & (adv < 0) & (ratio > dual_clip)
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    with torch.no_grad():
        clipped_upper = mask & (adv > 0) & (ratio > 1.0 + eps_high)
        clipped_lower = mask & (adv < 0) & (ratio < 1.0 - eps_low)
        stats = {
            "clipfrac_upper": masked_mean(clipped_upper.to(ratio.dtype), mask),
            "clipfrac_lower": masked_mean(clipped_lower.to(ratio.dtype), mask),
            "clipfrac": masked_mean((clipped_upper | clipped_lower).to(ratio.dtype), mask),
            "dual_clipfrac": masked_mean(dual_active.to(ratio.dtype), mask),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return pg, stats


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), aggregated by ``norm``.

    ratio = exp(logp - old); pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high));
    asymmetric eps is DAPO's clip-higher (Yu et al. 2025). Dual clip (Ye et al. 2020,
    arXiv:1912.09729), c > 1, for A < 0: pg = min(pg, -A * c).
    Stats: clipfrac_upper / clipfrac_lower (clip active with A > 0 / A < 0), clipfrac,
    dual_clipfrac, approx_kl = mean(old - new), ratio_mean; behav_weight_mean /
    behav_weight_max / capped_frac are 1.0 / 1.0 / 0.0 (no behaviour weight; all 0.0 when
    the mask is empty, like every stat).
    """
    mask = as_bool_mask(response_mask)
    _check_inputs(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _check_clip(eps_low, eps_high, dual_clip)
    pg, stats = _clipped_surrogate(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip
    )
    loss = aggregate_loss(pg, mask, norm)
    any_token = mask.any().to(pg.dtype)
    stats["behav_weight_mean"] = any_token
    stats["behav_weight_max"] = any_token
    stats["capped_frac"] = torch.zeros_like(any_token)
    return loss, stats_to_floats(stats)


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    behav_weight_cap: float | None = 5.0,
    apply_behav_weight: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO objective of AReaL (Fu et al. 2025, arXiv:2505.24298; Hilton et al. 2022).

    w = exp(prox - behav) (constant); ratio = exp(logp - prox), clipped around prox as in
    :func:`ppo_clip_loss`; token loss = w * pg. A token with w > ``behav_weight_cap`` gets
    loss 0 but stays in the mask, so it still counts in the normaliser (as in AReaL).
    ``apply_behav_weight=False`` keeps the cap but drops the factor w.
    With prox == behav this is exactly :func:`ppo_clip_loss` with old = prox.
    Stats as PPO (approx_kl = mean(prox - logp)) plus behav_weight_mean / behav_weight_max
    over valid tokens and capped_frac = fraction of valid tokens with w > cap.
    """
    mask = as_bool_mask(response_mask)
    _check_inputs(
        mask,
        logprobs=logprobs,
        prox_logprobs=prox_logprobs,
        behav_logprobs=behav_logprobs,
        advantages=advantages,
    )
    _check_clip(eps_low, eps_high, dual_clip)
    if behav_weight_cap is not None and behav_weight_cap <= 0:
        raise ValueError(f"behav_weight_cap must be > 0 or None, got {behav_weight_cap}")
    pg, stats = _clipped_surrogate(
        logprobs, prox_logprobs, advantages, mask, eps_low, eps_high, dual_clip
    )
    prox = zero_masked(prox_logprobs.detach(), mask)
    behav = zero_masked(behav_logprobs.detach(), mask)
    behav_weight = torch.exp(prox - behav)
    kept = mask if behav_weight_cap is None else mask & (behav_weight <= behav_weight_cap)
    factor = behav_weight if apply_behav_weight else torch.ones_like(behav_weight)
    # where(), not a product with the mask: a capped w may be inf, and inf * 0 = NaN.
    factor = zero_masked(factor, kept)
    loss = aggregate_loss(pg * factor, mask, norm)
    with torch.no_grad():
        stats["behav_weight_mean"] = masked_mean(behav_weight, mask)
        max_w = zero_masked(behav_weight, mask).amax() if mask.numel() else pg.new_zeros(())
        stats["behav_weight_max"] = max_w  # w > 0, so the zeros in masked slots never win
        stats["capped_frac"] = masked_mean((mask & ~kept).to(pg.dtype), mask)
    return loss, stats_to_floats(stats)


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "ppo": ppo_clip_loss,
    "decoupled_ppo": decoupled_ppo_loss,
}

"""Policy-gradient losses: PPO clip (+ dual clip) and AReaL's decoupled PPO objective.

Only ``logprobs`` carries gradient: anchor logprobs (old / proximal / behaviour) and
advantages are treated as constants and detached. Masked inputs are replaced before any
arithmetic, so garbage in a masked slot never reaches the loss or a gradient.
Stats are python floats, masked means over the given micro-batch; 0.0 for an empty mask.

Every loss takes ``token_weights`` (constant, [B, T], e.g. the rollout correction of
:mod:`relayrl.algos.rollout_correction`): the per-token loss is multiplied by it before
aggregation, a weight-0 token stays in the normaliser.

Each loss registers itself under its ``algo.policy_loss`` name with the registry's one
signature (:mod:`relayrl.algos.registry`): ``ppo`` and ``decoupled_ppo`` here.

Stat names: ``clipfrac_upper`` / ``clipfrac_lower`` are the fractions of tokens whose
*ratio* clip is active above (A > 0) / below (A < 0); ``dual_clipfrac`` is the dual-clip
fraction. veRL's ``pg_clipfrac_lower`` is the dual-clip fraction, not the lower ratio clip:
relayrl never emits a ``pg_clipfrac*`` key, so a dashboard built for veRL finds nothing
rather than a number with another meaning.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm, aggregate_loss
from relayrl.algos.masked import as_bool_mask, masked_mean, stats_to_floats, zero_masked
from relayrl.algos.registry import LossOutput, PolicyLossInputs, register_policy_loss
from relayrl.config import AlgoConfig, BehavWeightMode

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


def weighted(pg: Tensor, token_weights: Tensor | None, mask: Tensor) -> Tensor:
    """``pg * token_weights`` (constant weights; masked slots dropped before the product)."""
    if token_weights is None:
        return pg
    if token_weights.shape != mask.shape:
        raise ValueError(
            f"token_weights {tuple(token_weights.shape)} != response_mask {tuple(mask.shape)}"
        )
    return pg * zero_masked(token_weights.detach().to(pg.dtype), mask)


def clip_objective(
    ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (+ dual clip) per token, and stats.

    ``ratio`` may be a token ratio (PPO) or a sequence ratio broadcast to its tokens (GSPO);
    ``log_ratio`` is the token log-ratio logp - anchor the ``approx_kl`` stat is taken of.
    """
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
            "approx_kl": masked_mean(-log_ratio.detach(), mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
        }
    return pg, stats


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
    return clip_objective(ratio, adv, mask, eps_low, eps_high, dual_clip, log_ratio)


def masked_log_ratio(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mask, logp, log_ratio, advantages) with masked positions zeroed: log_ratio =
    logp - sg(old) (unclamped), advantages detached; the inputs' shapes are checked."""
    mask = as_bool_mask(response_mask)
    _check_inputs(mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    logp = zero_masked(logprobs, mask)
    log_ratio = logp - zero_masked(old_logprobs.detach(), mask)
    return mask, logp, log_ratio, zero_masked(advantages.detach(), mask)


def no_behaviour_weight_stats(like: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """behav_weight_mean / max = 1, capped_frac = 0 (0 everywhere for an empty mask)."""
    any_token = mask.any().to(like.dtype)
    return {
        "behav_weight_mean": any_token,
        "behav_weight_max": any_token,
        "capped_frac": torch.zeros_like(any_token),
    }


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
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
    loss = aggregate_loss(weighted(pg, token_weights, mask), mask, norm)
    stats.update(no_behaviour_weight_stats(pg, mask))
    return loss, stats_to_floats(stats)


BEHAV_WEIGHT_MODES: tuple[str, ...] = get_args(BehavWeightMode)
"""AReaL's behaviour-weight modes, as ``algo.behav_weight_mode`` lists them."""


def behaviour_weights(
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    response_mask: Tensor,
    mode: str = "token-mask",
    cap: float | None = 5.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """AReaL's behaviour importance weight w = pi_prox / pi_behav and what the cap does to it.

    Level: ``token-*``: w_t = exp(prox_t - behav_t); ``sequence-*``: the geometric mean over
    the sequence's tokens, w_i = exp(mean_t(prox_t - behav_t)), on each of its tokens (as
    AReaL's ``sequence_*`` modes). Action at the cap c:
    - ``mask`` (AReaL ``token_mask``, relayrl's default): w > c -> 0 (the token's loss is 0);
    - ``truncate`` (``token_truncate``): min(w, c);
    - ``clamp``: clamp(w, lower, c), lower defaulting to 1 / c (both sides bounded).
    ``cap=None`` leaves w alone (and clamp then only applies ``lower`` when given).
    Returns (factor, raw w, affected): factor is 0 in masked slots, affected marks the valid
    tokens whose factor differs from w (the ``capped_frac`` stat).
    """
    if mode not in BEHAV_WEIGHT_MODES:
        raise ValueError(f"unknown behav_weight_mode {mode!r}; known: {list(BEHAV_WEIGHT_MODES)}")
    if cap is not None and cap <= 0:
        raise ValueError(f"behav_weight_cap must be > 0 or None, got {cap}")
    if lower is not None and (lower <= 0 or (cap is not None and lower >= cap)):
        raise ValueError(f"behav_weight_lower must be in (0, cap), got {lower} (cap {cap})")
    mask = as_bool_mask(response_mask)
    log_w = zero_masked(prox_logprobs.detach(), mask) - zero_masked(behav_logprobs.detach(), mask)
    if mode.startswith("sequence"):
        n = mask.sum(-1, keepdim=True).clamp(min=1).to(log_w.dtype)
        log_w = (log_w.sum(-1, keepdim=True) / n).expand_as(log_w)
    w = torch.exp(log_w)
    action = mode.split("-", 1)[1]
    if action == "mask":
        kept = mask if cap is None else mask & (w <= cap)
        factor = zero_masked(w, kept)  # where(): a capped w may be inf, and inf * 0 = NaN
    else:
        low = lower if lower is not None else (1.0 / cap if cap is not None else None)
        low = low if action == "clamp" else None
        factor = zero_masked(w.clamp(min=low, max=cap), mask)
    affected = mask & (factor != w)
    return factor, zero_masked(w, mask), affected


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
    token_weights: Tensor | None = None,
    behav_weight_mode: str = "token-mask",
    behav_weight_lower: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO objective of AReaL (Fu et al. 2025, arXiv:2505.24298; Hilton et al. 2022).

    w = exp(prox - behav) (constant); ratio = exp(logp - prox), clipped around prox as in
    :func:`ppo_clip_loss`; token loss = f(w) * pg, f from ``behav_weight_mode`` (see
    :func:`behaviour_weights`; default ``token-mask``: a token with w > ``behav_weight_cap``
    gets loss 0 but stays in the mask, so it still counts in the normaliser, as in AReaL).
    ``apply_behav_weight=False`` keeps what the cap masks but drops the factor w (the
    rollout correction then supplies the weight: see ``relayrl.controller.offpolicy``).
    With prox == behav this is exactly :func:`ppo_clip_loss` with old = prox.
    Stats as PPO (approx_kl = mean(prox - logp)) plus behav_weight_mean / behav_weight_max
    (of the raw w) over valid tokens and capped_frac = fraction of valid tokens whose weight
    the mode changed (w > cap for the mask / truncate modes, w outside [lower, cap] for clamp).
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
    factor, w, affected = behaviour_weights(
        prox_logprobs, behav_logprobs, mask, behav_weight_mode, behav_weight_cap,
        behav_weight_lower,
    )  # fmt: skip
    pg, stats = _clipped_surrogate(
        logprobs, prox_logprobs, advantages, mask, eps_low, eps_high, dual_clip
    )
    if not apply_behav_weight:
        factor = (factor != 0).to(factor.dtype)
    loss = aggregate_loss(weighted(pg * factor, token_weights, mask), mask, norm)
    with torch.no_grad():
        stats["behav_weight_mean"] = masked_mean(w, mask)
        stats["behav_weight_max"] = w.amax() if mask.numel() else pg.new_zeros(())
        stats["capped_frac"] = masked_mean(affected.to(pg.dtype), mask)
    return loss, stats_to_floats(stats)


@register_policy_loss("ppo", off_policy="behaviour")
def ppo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`ppo_clip_loss` around ``x.old_logprobs`` (off the sync schedule naive PPO: the
    controller makes pi_old the engine's behaviour logprobs)."""
    return ppo_clip_loss(x.logprobs, old_logprobs=x.old_logprobs, **x.common(algo))


@register_policy_loss("decoupled_ppo", off_policy="in_loss")
def decoupled_ppo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`decoupled_ppo_loss` with pi_prox = ``x.old_logprobs``, pi_behav =
    ``x.behaviour_logprobs`` and ``algo.behav_weight_*``. A rollout-correction weight in
    ``x.token_weights`` (the same ratio pi_prox / pi_behav, ``algo.rollout_correction.mode``
    other than none) replaces the behaviour weight; what the behaviour-weight mode masks stays
    masked. Mode none (reject_kl only) keeps the behaviour weight and only adds the rejections.
    """
    if x.behaviour_logprobs is None:
        raise ValueError("decoupled_ppo needs the batch's behaviour logprobs (pi_behav)")
    replaced = x.token_weights is not None and algo.rollout_correction.mode != "none"
    return decoupled_ppo_loss(
        x.logprobs,
        prox_logprobs=x.old_logprobs,
        behav_logprobs=x.behaviour_logprobs,
        behav_weight_cap=algo.behav_weight_cap,
        behav_weight_mode=algo.behav_weight_mode,
        behav_weight_lower=algo.behav_weight_lower,
        apply_behav_weight=not replaced,
        **x.common(algo),
    )

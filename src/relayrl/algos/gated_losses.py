"""Policy losses that bound the importance weight instead of clipping the surrogate:
CISPO (MiniMax-M1, 2025) and SAPO (Qwen, 2025).

PPO's clip zeroes the gradient of a token whose ratio left the trust region; these keep
every token's gradient and bound its size instead. Inputs, masking and stats follow
:mod:`relayrl.algos.policy_loss`; each registers itself (``cispo``, ``sapo``:
:mod:`relayrl.algos.registry`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm, aggregate_loss
from relayrl.algos.masked import masked_mean, stats_to_floats
from relayrl.algos.policy_loss import (
    LOG_RATIO_LIMIT,
    _check_clip,
    masked_log_ratio,
    no_behaviour_weight_stats,
    weighted,
)
from relayrl.algos.registry import LossOutput, PolicyLossInputs, register_policy_loss
from relayrl.config import AlgoConfig


def _token_ratio(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``masked_log_ratio`` with the log-ratio clamped and its exp, the token ratio r_t."""
    mask, logp, log_ratio, adv = masked_log_ratio(logprobs, old_logprobs, advantages, response_mask)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return mask, logp, log_ratio, torch.exp(log_ratio), adv


def _no_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip is not defined for the {name} loss (set algo.dual_clip: null)")


def cispo_loss(
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
    """CISPO (MiniMax-M1, arXiv:2506.13585): clipped, stop-gradient IS weight times logprob.

    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi_t, r_t = pi_t / pi_old,t:
    every token keeps the REINFORCE gradient -w A grad log pi, its weight w bounded. As
    veRL's ``cispo``, both sides are clipped; the paper bounds only the top (set
    ``clip_eps_low`` close to 1 for that). The loss value is -w A log pi (its gradient is the
    point, not its value). Stats: clipfrac_upper / clipfrac_lower = tokens with r above /
    below the range, whatever the sign of A (the weight is clipped for both signs).
    """
    _no_dual_clip("cispo", dual_clip)
    mask, logp, log_ratio, ratio, adv = _token_ratio(
        logprobs, old_logprobs, advantages, response_mask
    )
    _check_clip(eps_low, eps_high, None)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach()
    pg = -weight * adv * logp
    loss = aggregate_loss(weighted(pg, token_weights, mask), mask, norm)
    with torch.no_grad():
        dtype = ratio.dtype
        upper = mask & (ratio > 1.0 + eps_high)
        lower = mask & (ratio < 1.0 - eps_low)
        stats = {
            "clipfrac_upper": masked_mean(upper.to(dtype), mask),
            "clipfrac_lower": masked_mean(lower.to(dtype), mask),
            "clipfrac": masked_mean((upper | lower).to(dtype), mask),
            "dual_clipfrac": torch.zeros((), dtype=dtype),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            **no_behaviour_weight_stats(ratio, mask),
        }
    return loss, stats_to_floats(stats)


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, float]]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate replaces the hard clip: f(r) = sigmoid(tau (r - 1)) * 4 / tau with
    tau = tau_pos for A > 0, tau_neg for A <= 0 (veRL's defaults 1.0 / 1.05); loss_t = -f(r_t) A_t.
    d f / d log r = 4 sigma (1 - sigma) r is 1 at r = 1 (the plain policy gradient on policy)
    and decays smoothly away from it. ``eps_low`` / ``eps_high`` are not used (no clip).
    Stats: clipfrac* are 0; gate_mean is the mean of f(r).
    """
    _no_dual_clip("sapo", dual_clip)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    mask, _, log_ratio, ratio, adv = _token_ratio(logprobs, old_logprobs, advantages, response_mask)
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg = -gate * adv
    loss = aggregate_loss(weighted(pg, token_weights, mask), mask, norm)
    with torch.no_grad():
        zero = torch.zeros((), dtype=ratio.dtype)
        stats = {
            "clipfrac_upper": zero,
            "clipfrac_lower": zero,
            "clipfrac": zero,
            "dual_clipfrac": zero,
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "gate_mean": masked_mean(gate, mask),
            **no_behaviour_weight_stats(ratio, mask),
        }
    return loss, stats_to_floats(stats)


@register_policy_loss("cispo")
def cispo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`cispo_loss` around ``x.old_logprobs``."""
    return cispo_loss(x.logprobs, old_logprobs=x.old_logprobs, **x.common(algo))


@register_policy_loss("sapo")
def sapo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`sapo_loss` around ``x.old_logprobs``, gate temperatures ``algo.sapo_tau_pos``
    / ``algo.sapo_tau_neg``."""
    return sapo_loss(
        x.logprobs,
        old_logprobs=x.old_logprobs,
        tau_pos=algo.sapo_tau_pos,
        tau_neg=algo.sapo_tau_neg,
        **x.common(algo),
    )

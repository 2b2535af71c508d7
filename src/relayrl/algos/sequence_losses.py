"""Sequence-level ratio losses: GSPO, GSPO-token (Qwen, 2025) and GMPO (2025).

The importance ratio of a sequence is the geometric mean of its token ratios,
s_i = exp(mean_t log(pi / pi_old)), so one long sequence's noisy tokens do not dominate
the update. Each function returns a per-token loss matrix aggregated by ``norm``: the loss
of sequence i sits on each of its tokens. With ``loss_agg: seq-mean-token-mean`` (what the
papers and veRL use; veRL forces it for GSPO and takes a plain row mean for GMPO) the loss is
the mean over sequences; relayrl honours whatever ``loss_agg`` says (``token-mean`` weights
a sequence by its length). Inputs, masking and stats follow :mod:`relayrl.algos.policy_loss`;
each registers itself (``gspo``, ``gspo_token``, ``gmpo``: :mod:`relayrl.algos.registry`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm, aggregate_loss
from relayrl.algos.masked import masked_mean, stats_to_floats
from relayrl.algos.policy_loss import (
    LOG_RATIO_LIMIT,
    _check_clip,
    clip_objective,
    masked_log_ratio,
    no_behaviour_weight_stats,
    weighted,
)
from relayrl.algos.registry import LossOutput, PolicyLossInputs, register_policy_loss
from relayrl.config import AlgoConfig


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """mean_t x over each row's valid tokens, [B, 1] (0 for an empty row)."""
    return masked_mean(x, mask, dim=-1).unsqueeze(-1)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), the sequence-level objective.

    s_i = exp((1/|y_i|) sum_t log(pi_t / pi_old,t)) (gradient through every token);
    loss_i = max(-A s_i, -A clip(s_i, 1 - eps_low, 1 + eps_high)), on each token t of
    sequence i with A = A_i,t (GRPO's advantage is the same on every token, as the paper's
    A_i; a token-varying A makes each token's term its own). The paper's clip range is
    3e-4 / 4e-4 (set ``algo.clip_eps_low`` / ``clip_eps_high``). A one-token sequence has
    s_i = its token ratio, so GSPO is then PPO-clip. Dual clip as in PPO, on s_i.
    Stats as :func:`~relayrl.algos.policy_loss.ppo_clip_loss`, counted per token of a clipped
    sequence; ratio_mean is the mean of s_i over tokens.
    """
    mask, _, log_ratio, adv = masked_log_ratio(logprobs, old_logprobs, advantages, response_mask)
    _check_clip(eps_low, eps_high, dual_clip)
    seq_log_ratio = _row_mean(log_ratio, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(seq_log_ratio).expand_as(log_ratio)
    pg, stats = clip_objective(ratio, adv, mask, eps_low, eps_high, dual_clip, log_ratio)
    loss = aggregate_loss(weighted(pg, token_weights, mask), mask, norm)
    stats.update(no_behaviour_weight_stats(pg, mask))
    return loss, stats_to_floats(stats)


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token (arXiv:2507.18071 sec. 4.3; veRL's ``gspo`` loss computes this one).

    s_i,t = sg[s_i] * pi_t / sg[pi_t]: the value of every token's ratio is the sequence's s_i
    (so the clip decision is per sequence), but each token's gradient is s_i * grad log pi_t
    with its own advantage A_i,t; loss_t = max(-A_i,t s_i,t, -A_i,t clip(s_i,t)). With one
    advantage per sequence and ``seq-mean-token-mean`` its value and gradient equal
    :func:`gspo_loss`'s.
    """
    mask, logp, log_ratio, adv = masked_log_ratio(logprobs, old_logprobs, advantages, response_mask)
    _check_clip(eps_low, eps_high, dual_clip)
    seq_log_ratio = _row_mean(log_ratio, mask).detach()
    log_s = (seq_log_ratio + logp - logp.detach()).clamp(max=LOG_RATIO_LIMIT)
    ratio = torch.exp(log_s)
    pg, stats = clip_objective(ratio, adv, mask, eps_low, eps_high, dual_clip, log_ratio)
    loss = aggregate_loss(weighted(pg, token_weights, mask), mask, norm)
    stats.update(no_behaviour_weight_stats(pg, mask))
    return loss, stats_to_floats(stats)


def gmpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    dual_clip: float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673).

    Token log-ratios are clipped in log space, sign-aware like PPO's clip:
    l_t = sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high));
    the sequence ratio is exp(mean_t l_t) and loss_i = -A_i * exp(mean_t l_t), A_i the mean
    advantage of the sequence (as veRL's ``geo_mean``). The clip range is in log space: the
    paper's (e^-0.4, e^0.4) is eps 0.4. A clipped token's gradient is 0. Token weights enter as
    their geometric mean over the sequence (as veRL does); a weight-0 token zeroes its
    sequence. No dual clip.
    Stats: clipfrac_upper / clipfrac_lower = tokens whose log-ratio clip is active with
    A > 0 / A < 0; ratio_mean = mean over tokens of the sequence ratio.
    """
    if dual_clip is not None:
        raise ValueError("dual_clip is not defined for the gmpo loss (set algo.dual_clip: null)")
    mask, _, log_ratio, adv = masked_log_ratio(logprobs, old_logprobs, advantages, response_mask)
    _check_clip(eps_low, eps_high, None)
    sgn = torch.sign(adv)
    clamped = log_ratio.clamp(-eps_low, eps_high)
    chosen = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    seq_ratio = torch.exp(_row_mean(chosen, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    seq_adv = _row_mean(adv, mask)
    seq_loss = -seq_adv * seq_ratio
    if token_weights is not None:
        weights = weighted(torch.ones_like(log_ratio), token_weights, mask).detach()
        log_w = torch.where(mask, torch.log(weights), torch.zeros_like(weights))
        seq_loss = seq_loss * torch.exp(_row_mean(log_w, mask))
    pg = seq_loss.expand_as(log_ratio)
    loss = aggregate_loss(pg, mask, norm)
    with torch.no_grad():
        upper = mask & (adv > 0) & (log_ratio > eps_high)
        lower = mask & (adv < 0) & (log_ratio < -eps_low)
        dtype = log_ratio.dtype
        stats = {
            "clipfrac_upper": masked_mean(upper.to(dtype), mask),
            "clipfrac_lower": masked_mean(lower.to(dtype), mask),
            "clipfrac": masked_mean((upper | lower).to(dtype), mask),
            "dual_clipfrac": torch.zeros((), dtype=dtype),
            "approx_kl": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(seq_ratio.expand_as(log_ratio), mask),
            **no_behaviour_weight_stats(log_ratio, mask),
        }
    return loss, stats_to_floats(stats)


@register_policy_loss("gspo")
def gspo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`gspo_loss` around ``x.old_logprobs``."""
    return gspo_loss(x.logprobs, old_logprobs=x.old_logprobs, **x.common(algo))


@register_policy_loss("gspo_token")
def gspo_token(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`gspo_token_loss` around ``x.old_logprobs``."""
    return gspo_token_loss(x.logprobs, old_logprobs=x.old_logprobs, **x.common(algo))


@register_policy_loss("gmpo")
def gmpo(x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
    """:func:`gmpo_loss` around ``x.old_logprobs``."""
    return gmpo_loss(x.logprobs, old_logprobs=x.old_logprobs, **x.common(algo))

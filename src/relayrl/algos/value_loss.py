"""Critic loss: the clipped value loss of PPO implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm, aggregate_loss
from relayrl.algos.masked import as_bool_mask, masked_mean, stats_to_floats, zero_masked


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    norm: LossNorm,
    clip_range: float | None = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 in OpenAI baselines, Schulman et al. 2017; used by InstructGPT).

    loss_t = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), aggregated by
    ``norm``; ``clip_range=None`` gives the plain 0.5 * (V - R)^2. Only ``values`` carries
    gradient (old values and returns are detached). Stats: vf_clipfrac (fraction of valid
    tokens where the clipped term is the larger one) and vpred_mean (masked mean of V).
    """
    mask = as_bool_mask(response_mask)
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        if x.shape != mask.shape or x.dim() != 2:
            raise ValueError(f"{name} {tuple(x.shape)} != response_mask {tuple(mask.shape)}")
    if clip_range is not None and clip_range < 0:
        raise ValueError(f"clip_range must be >= 0 or None, got {clip_range}")
    v = zero_masked(values, mask)
    old = zero_masked(old_values.detach(), mask)
    ret = zero_masked(returns.detach(), mask)
    loss_unclipped = (v - ret) ** 2
    if clip_range is None:
        per_token = 0.5 * loss_unclipped
        clip_active = torch.zeros_like(mask)
    else:
        v_clipped = torch.clamp(v, old - clip_range, old + clip_range)
        loss_clipped = (v_clipped - ret) ** 2
        per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        clip_active = mask & (loss_clipped > loss_unclipped)
    loss = aggregate_loss(per_token, mask, norm)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clip_active.to(v.dtype), mask),
            "vpred_mean": masked_mean(v, mask),
        }
    return loss, stats_to_floats(stats)

"""Losses on preference pairs: Bradley-Terry for reward models, DPO for policies.

Both are -mean log sigmoid(margin) = mean softplus(-margin), over a margin that differs:

- Bradley-Terry (reward-model training, InstructGPT, Ouyang et al. 2022): r_c - r_r.
- DPO (Rafailov et al. 2023): beta [(log pi(y_w|x) - log pi_ref(y_w|x))
  - (log pi(y_l|x) - log pi_ref(y_l|x))] on sequence logprobs.

Accuracy counts a margin > 0 as 1 and a tie as 1/2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["bradley_terry_loss", "dpo_loss"]


def bradley_terry_loss(r_chosen: Tensor, r_rejected: Tensor) -> tuple[Tensor, dict[str, float]]:
    """L = -mean log sigmoid(r_c - r_r) = mean softplus(-(r_c - r_r)) (Bradley-Terry).

    Stats: ``accuracy`` = mean [r_c > r_r] (ties 1/2), ``margin`` = mean (r_c - r_r).
    """
    diff = r_chosen - r_rejected
    loss = F.softplus(-diff).mean()
    with torch.no_grad():
        acc = ((diff > 0).float() + 0.5 * (diff == 0).float()).mean()
    return loss, {"accuracy": float(acc), "margin": float(diff.detach().mean())}


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> tuple[Tensor, dict[str, float]]:
    """L = -mean log sigmoid(beta [(pi_w - ref_w) - (pi_l - ref_l)]) on sequence logprobs.

    Stats: ``accuracy`` (h > 0, ties 1/2), ``chosen_reward`` / ``rejected_reward`` (mean
    implicit rewards beta (log pi - log pi_ref)), ``margin`` (their mean difference).
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    h = chosen_reward - rejected_reward
    loss = F.softplus(-h).mean()
    with torch.no_grad():
        acc = ((h > 0).float() + 0.5 * (h == 0).float()).mean()
    return loss, {
        "accuracy": float(acc),
        "chosen_reward": float(chosen_reward.detach().mean()),
        "rejected_reward": float(rejected_reward.detach().mean()),
        "margin": float(h.detach().mean()),
    }

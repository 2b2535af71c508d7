"""The policy losses by the name ``algo.policy_loss`` gives them.

Every entry takes (logprobs, old_logprobs, advantages, response_mask, norm, eps_low,
eps_high, dual_clip, token_weights) -- ``decoupled_ppo`` takes prox / behav logprobs in
place of old_logprobs, ``sapo`` takes tau_pos / tau_neg -- and returns (loss, stats).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from relayrl.algos.gated_losses import cispo_loss, sapo_loss
from relayrl.algos.policy_loss import decoupled_ppo_loss, ppo_clip_loss
from relayrl.algos.sequence_losses import gmpo_loss, gspo_loss, gspo_token_loss

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "ppo": ppo_clip_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "gmpo": gmpo_loss,
}

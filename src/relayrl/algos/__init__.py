"""relayrl.algos: the RL math as pure PyTorch tensor functions (no I/O, no models).

Tensors are [B, T] over response tokens; ``response_mask`` may have holes and masked
positions never influence an output or a gradient. Loss normalisation is step-global
(:class:`LossNorm`), so gradients do not depend on micro-batching.
"""

from relayrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_drgrpo,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    discounted_returns,
)
from relayrl.algos.aggregation import AGGREGATION_MODES, LossNorm, aggregate_loss
from relayrl.algos.entropy import entropy_from_logits, logprobs_from_logits
from relayrl.algos.gated_losses import cispo_loss, sapo_loss
from relayrl.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
)
from relayrl.algos.masked import (
    as_bool_mask,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from relayrl.algos.policy_loss import (
    BEHAV_WEIGHT_MODES,
    behaviour_weights,
    decoupled_ppo_loss,
    ppo_clip_loss,
)
from relayrl.algos.registry import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossInputs,
    get_policy_loss,
    register_policy_loss,
)
from relayrl.algos.rollout_correction import CORRECTION_MODES, mismatch_stats, rollout_correction
from relayrl.algos.sequence_losses import gmpo_loss, gspo_loss, gspo_token_loss
from relayrl.algos.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "BEHAV_WEIGHT_MODES",
    "CORRECTION_MODES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossInputs",
    "AdaptiveKLController",
    "FixedKLController",
    "LossNorm",
    "aggregate_loss",
    "apply_kl_to_rewards",
    "as_bool_mask",
    "behaviour_weights",
    "cispo_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_drgrpo",
    "compute_gae",
    "compute_grpo",
    "compute_reinforce_plus_plus",
    "compute_reinforce_plus_plus_baseline",
    "compute_rloo",
    "decoupled_ppo_loss",
    "discounted_returns",
    "entropy_from_logits",
    "get_policy_loss",
    "gmpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_stats",
    "ppo_clip_loss",
    "register_policy_loss",
    "rollout_correction",
    "sapo_loss",
]

"""RLHF: reward models from preference pairs, RM-scored RL, DPO, and the reward-hacking lab.

Modules, lowest first:

- ``preferences``  -- preference pairs from JSONL / local HF datasets, bad-row handling
- ``reward_model`` -- Bradley-Terry reward-model training (``relayrl rm``), HF format
- ``rm_scorer``    -- a reward model as a batched scorer; mixing with rule-based rewards
- ``monitors``     -- per-step KL, distinct-n and proxy-vs-gold divergence
- ``city_lang``    -- the synthetic city language with a known true score
- ``dpo``          -- offline DPO (``algo.name: dpo`` / ``relayrl dpo``)
- ``lab``          -- ``relayrl demo rlhf``: SFT -> pairs -> RM -> PPO(beta) -> report

The first five import only the model, data, reward, workers and telemetry layers (the
controller imports ``monitors`` and the local cluster ``rm_scorer``); ``dpo`` and ``lab`` are
recipes on top of the controller and are not imported here.
"""

from relayrl.rlhf.monitors import RunMonitor, distinct_n, distinct_responses, sequence_kl
from relayrl.rlhf.preferences import (
    PreferenceData,
    PreferencePair,
    load_preferences,
    write_preferences,
)
from relayrl.rlhf.reward_model import (
    RMConfig,
    bradley_terry_loss,
    evaluate_pairs,
    load_reward_model,
    train_reward_model,
)
from relayrl.rlhf.rm_scorer import (
    BatchScorer,
    MixedReward,
    RewardModelScorer,
    build_reward_fn,
    reward_model_scorers,
)

__all__ = [
    "BatchScorer",
    "MixedReward",
    "PreferenceData",
    "PreferencePair",
    "RMConfig",
    "RewardModelScorer",
    "RunMonitor",
    "bradley_terry_loss",
    "build_reward_fn",
    "distinct_n",
    "distinct_responses",
    "evaluate_pairs",
    "load_preferences",
    "load_reward_model",
    "reward_model_scorers",
    "sequence_kl",
    "train_reward_model",
    "write_preferences",
]

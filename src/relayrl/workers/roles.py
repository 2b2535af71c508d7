"""The set of roles one RL program drives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.rollout import RolloutEngine
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.reward import RewardWorker


@dataclass
class Roles:
    actor: ActorWorker
    rollout: RolloutEngine
    reward: RewardWorker
    tokenizer: Any
    reference: ReferenceWorker | None = None
    critic: CriticWorker | None = None

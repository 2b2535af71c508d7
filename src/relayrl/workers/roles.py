"""The set of roles one RL program drives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relayrl.reward.scorer import Scorer
from relayrl.rollout.backend import RolloutBackend
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker


@dataclass
class Roles:
    actor: ActorWorker
    rollout: RolloutBackend
    """The own engine, vLLM, a client of engine workers or replicas, or the episode / agent
    runner over one (``relayrl.rollout.backend``)."""
    reward: Scorer
    """The ``RewardWorker``, or the ``EpisodeScorer`` over it (``relayrl.reward.scorer``)."""
    tokenizer: Any
    reference: ReferenceWorker | None = None
    critic: CriticWorker | None = None
    teacher: ReferenceWorker | None = None
    """On-policy distillation's teacher (``algo.distill``; loaded by the controller)."""
    on_close: Callable[[], None] | None = None
    """Run last by ``close`` (the local cluster: leave the process group it started)."""

    def close(self) -> None:
        """Stop worker processes (an engine worker, when the rollout runs in one)."""
        self.rollout.close()
        self.reward.close()
        if self.on_close is not None:
            self.on_close()

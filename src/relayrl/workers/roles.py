"""The set of roles one RL program drives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relayrl.rollout import RolloutEngine
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.reward import RewardWorker


@dataclass
class Roles:
    actor: ActorWorker
    rollout: RolloutEngine | Any  # the engine or a client of engine workers: same methods, report()
    reward: RewardWorker
    tokenizer: Any
    reference: ReferenceWorker | None = None
    critic: CriticWorker | None = None
    teacher: ReferenceWorker | None = None
    """On-policy distillation's teacher (``algo.distill``; loaded by the controller)."""
    on_close: Callable[[], None] | None = None
    """Run last by ``close`` (the local cluster: leave the process group it started)."""

    def close(self) -> None:
        """Stop worker processes (an engine worker, when the rollout runs in one)."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()
        self.reward.close()
        if self.on_close is not None:
            self.on_close()

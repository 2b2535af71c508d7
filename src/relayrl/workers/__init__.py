"""Roles: actor, reference, critic, reward and rollout, each driven by the controller."""

from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.experience import Experience
from relayrl.workers.reward import RewardWorker
from relayrl.workers.roles import Roles

__all__ = ["ActorWorker", "CriticWorker", "Experience", "ReferenceWorker", "RewardWorker", "Roles"]

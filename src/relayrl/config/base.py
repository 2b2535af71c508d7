"""The run config's building blocks: value types, the strict base model and its errors.

``relayrl.config`` re-exports every name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator


def _thread_count(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    raise ValueError("must be a whole number >= 1 or 'auto'")


Threads = Annotated[int | Literal["auto"], PlainValidator(_thread_count)]
"""A torch thread count, or ``auto``: the CPUs idle when the process starts, within its
affinity mask (``relayrl.model.threads``)."""


Seed = Annotated[int, Field(ge=0, lt=2**63)]  # torch takes 64 bits; numpy no negatives
Fraction = Annotated[float, Field(ge=0, le=1)]
AdamBeta = Annotated[float, Field(ge=0, lt=1)]
"""An Adam moment decay: 1 or more never forgets (the moment estimates diverge)."""

GROUP_ADVANTAGES = frozenset({"grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"})
"""Advantages relative to the prompt's group: with one sample per prompt every one is 0."""


BehavWeightMode = Literal[
    "token-mask",
    "token-truncate",
    "token-clamp",
    "sequence-mask",
    "sequence-truncate",
    "sequence-clamp",
]
"""Decoupled PPO's behaviour-weight modes (AReaL): mask / truncate / clamp, per token or per
sequence (geometric mean); ``relayrl.algos.policy_loss.behaviour_weights`` implements them."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message is one line naming the problem."""


class KeyProblem(ValueError):
    """A cross-field check's error: the key (relative to the checking model), its value and
    the other keys involved, so the message names the key and where it was set."""

    def __init__(self, key: str, value: Any, message: str, related: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.value, self.message, self.related = key, value, message, related


class _Strict(BaseModel):
    """Unknown keys are errors; floats must be finite (unbounded options are ``null``)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

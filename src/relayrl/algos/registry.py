"""The policy losses by the name ``algo.policy_loss`` gives them, all with one signature.

A policy loss is ``fn(x: PolicyLossInputs, algo: AlgoConfig) -> (loss, stats)``: ``x`` holds
one micro-batch's tensors (log pi_theta with gradient, pi_old, pi_behav, A, the mask, the
step's ``LossNorm``, constant per-token weights), ``algo`` the run's algorithm section, from
which the loss reads its own settings (clip range, its own knobs). It returns the scalar loss
(aggregated with ``x.norm``, never a local mean) and a dict of stats: masked means over the
micro-batch's tokens, which the actor weights by its token count (a step's mean over all its
tokens, whatever the micro-batches and ranks), except a stat named ``*_max``, a maximum, which
the actor reports as the maximum over the step. A loss registers itself
where it is defined::

    @register_policy_loss("my_loss")
    def my_loss(x: PolicyLossInputs, algo: AlgoConfig) -> tuple[Tensor, dict[str, Any]]:
        ...

and ``algo.policy_loss: my_loss`` selects it; nothing else changes (the actor looks it up by
name and never branches on it). ``off_policy`` says how the loss meets stale data (the
overlap and async schedules), read by ``relayrl.controller.offpolicy``:

- ``weight`` (the default; gspo, cispo, sapo, gmpo, ...): pi_old is the trainer's (pi_prox)
  and the controller multiplies decoupled PPO's behaviour weight f(pi_prox / pi_behav) into
  ``x.token_weights`` (unless ``algo.rollout_correction.mode`` supplies that weight);
- ``in_loss`` (decoupled_ppo): the loss weights by pi_prox / pi_behav itself, from
  ``x.old_logprobs`` and ``x.behaviour_logprobs``;
- ``behaviour`` (naive ppo): off the sync schedule pi_old *is* the engine's behaviour
  logprobs (the clip is centred on the policy that generated the tokens), no weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from relayrl.algos.aggregation import LossNorm
from relayrl.config import AlgoConfig

OffPolicy = Literal["weight", "in_loss", "behaviour"]
LossOutput = tuple[Tensor, dict[str, Any]]


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's inputs to a policy loss; every tensor is [B, T] over response tokens.

    ``logprobs``: log pi_theta(y_t), with gradient (nats). ``old_logprobs``: log pi_old, the
    anchor of the ratio (decoupled PPO's pi_prox), constant. ``behaviour_logprobs``: log
    pi_behav, the engine's at sampling time, constant (None where the batch has none).
    ``advantages``: A_t, constant. ``response_mask``: 1.0 on trained tokens. ``norm``: the
    step-global normaliser. ``token_weights``: constant per-token weights of the loss
    (rollout / off-policy correction) or None.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor | None
    advantages: Tensor
    response_mask: Tensor
    norm: LossNorm
    token_weights: Tensor | None = None

    def common(self, algo: AlgoConfig) -> dict[str, Any]:
        """The keyword arguments every loss function of ``relayrl.algos`` shares: advantages,
        mask, norm, the clip range (eps_low, eps_high, dual_clip) and the token weights."""
        return {
            "advantages": self.advantages,
            "response_mask": self.response_mask,
            "norm": self.norm,
            "eps_low": algo.clip_eps_low,
            "eps_high": algo.clip_eps_high,
            "dual_clip": algo.dual_clip,
            "token_weights": self.token_weights,
        }


PolicyLossFn = Callable[[PolicyLossInputs, AlgoConfig], LossOutput]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its name, its function and how it meets stale data."""

    name: str
    fn: PolicyLossFn
    off_policy: OffPolicy = "weight"

    def __call__(self, x: PolicyLossInputs, algo: AlgoConfig) -> LossOutput:
        return self.fn(x, algo)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(
    name: str, off_policy: OffPolicy = "weight"
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn`` as the policy loss ``name`` (a name registered twice is a
    ValueError, unless it is the same function again, as a module reload gives)."""

    def add(fn: PolicyLossFn) -> PolicyLossFn:
        old = POLICY_LOSSES.get(name)
        if old is not None and _where(old.fn) != _where(fn):
            raise ValueError(f"policy loss {name!r} is already registered ({old.fn.__module__})")
        POLICY_LOSSES[name] = PolicyLoss(name, fn, off_policy)
        return fn

    return add


def _where(fn: PolicyLossFn) -> tuple[str, str]:
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``; a ValueError naming the registered ones otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        known = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"unknown algo.policy_loss {name!r}; registered: {known}") from None

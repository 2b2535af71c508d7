"""KL estimators between the policy and a reference, KL-shaped rewards, KL coefficient control.

Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating
KL Divergence"), with d = logp - ref:
k1 = d (unbiased, high variance), k2 = d^2 / 2, k3 = exp(-d) + d - 1 (unbiased, >= 0; the
"low-variance KL" of GRPO), abs = |d|. Use them in the reward (InstructGPT / PPO) through
:func:`apply_kl_to_rewards`, or as a loss term (GRPO) through ``aggregate_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relayrl.algos.masked import as_bool_mask, zero_masked

K3_CLAMP = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio**2


def _k3(log_ratio: Tensor) -> Tensor:
    # exp(x) - x - 1 with x = ref - logp = -d; expm1 keeps precision when d is small.
    return (torch.expm1(-log_ratio) + log_ratio).clamp(-K3_CLAMP, K3_CLAMP)


def _abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
}


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, kind: str, response_mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate (Schulman 2020), d = logp - ref:
    k1 = d; k2 = 0.5 d^2; k3 = exp(-d) + d - 1 clamped to [-10, 10] (DeepSeekMath GRPO);
    abs = |d|. With ``response_mask`` the output (and gradient) is exactly 0 where masked.
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {sorted(KL_ESTIMATORS)}") from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
        )
    if response_mask is None:
        return estimator(logprobs - ref_logprobs)
    mask = as_bool_mask(response_mask)
    log_ratio = zero_masked(logprobs, mask) - zero_masked(ref_logprobs, mask)
    return zero_masked(estimator(log_ratio), mask)


def apply_kl_to_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    beta: float,
    kind: str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL-shaped token rewards (InstructGPT, Ouyang et al. 2022; Ziegler et al. 2019).

    r_t = -beta * KL_t on every valid response token, plus the sequence score on its LAST
    valid token; 0 where masked. A sequence with no valid token has nowhere to receive its
    score: it is dropped. Returns (token_rewards, per-token kl). Nothing is detached: call
    it on detached logprobs (as a rollout-time reward) unless you want the gradient.
    """
    mask = as_bool_mask(response_mask)
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"scores must be [B] = [{mask.shape[0]}], got {tuple(scores.shape)}")
    kl = kl_penalty(logprobs, ref_logprobs, kind, response_mask=mask)
    batch, length = mask.shape
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    last = torch.where(mask, positions, -1).amax(-1) if length else positions.new_full((batch,), -1)
    has_tokens = last >= 0
    score = torch.where(has_tokens, scores.to(kl.dtype), torch.zeros((), dtype=kl.dtype))
    bonus = torch.zeros_like(kl).scatter(1, last.clamp(min=0)[:, None], score[:, None])
    token_rewards = zero_masked(-beta * kl + bonus, mask)
    return token_rewards, kl


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same interface as :class:`AdaptiveKLController`)."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593).

    err = clip(kl / target - 1, -0.2, 0.2); beta <- beta * (1 + err * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards keeping the measured KL at the target."""
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


KL_CONTROLLERS: dict[str, type[FixedKLController] | type[AdaptiveKLController]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
}

"""The Tinker SDK's built-in losses, per datum, as the Tinker docs define them.

Every loss is a plain SUM over the datum's tokens (Tinker's reduction; no normaliser), and a
forward_backward call's loss is the sum over its datums. ``target_lp`` is the trainer's
logprob of ``target_tokens`` at each position (position i of the input predicts target i).

- ``cross_entropy``:        -sum(w * lp)                 (inputs: target_tokens, weights; both
                            [N] or [N, K]: K target tokens per position, top-K distillation)
- ``importance_sampling``:  -sum(exp(lp - q) * A)        (+ logprobs q, advantages A)
- ``ppo``:                  -sum(min(r * A, clip(r, lo, hi) * A)), r = exp(lp - q)
- ``cispo``:                -sum(sg(clip(r, lo, hi)) * lp * A)
- ``dro``:                  -sum(lp * A - beta / 2 * (lp - q)^2)

``ppo`` and ``cispo`` take ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds,
default 0.8 / 1.2) and are computed by relayrl's :func:`relayrl.algos.ppo_clip_loss` /
:func:`relayrl.algos.gated_losses.cispo_loss` with the ``token-sum`` aggregation
(eps_low = 1 - lo, eps_high = hi - 1). Where they differ from Tinker's text: relayrl clamps the
log-ratio to +-20 before exp (a ratio beyond e^20 is a broken sample); below that they agree
to float precision (tests/unit/tinker/test_tinker_losses.py). ``dro``'s ``beta`` defaults to 0.05.
A NaN or infinite ``weights`` / ``logprobs`` / ``advantages`` entry is refused (it would make
the loss and every accumulated gradient NaN).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from relayrl.algos.aggregation import LossNorm
from relayrl.algos.gated_losses import cispo_loss
from relayrl.algos.policy_loss import ppo_clip_loss

BUILTIN_LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""Loss name -> the ``loss_fn_inputs`` it reads (``weights`` defaults to ones)."""

UNSUPPORTED_LOSSES = ("gspo", "stable_reinforce", "custom")
"""Names the SDK lists that this service refuses (a user error naming the supported ones)."""

DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}


class LossInputError(ValueError):
    """A request the loss cannot run on (unknown loss, missing input, shapes that differ)."""


def check_loss(name: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """The loss's full config (defaults filled in); unknown names and keys are errors."""
    if name not in BUILTIN_LOSSES:
        raise LossInputError(
            f"loss_fn {name!r} is not supported by relayrl's Tinker service; supported: "
            f"{', '.join(BUILTIN_LOSSES)} (custom losses: forward_backward_custom)"
        )
    out = dict(DEFAULT_CONFIG.get(name, {}))
    for key, value in (config or {}).items():
        if key not in out:
            raise LossInputError(
                f"loss_fn_config key {key!r} is not a parameter of {name!r} "
                f"(parameters: {', '.join(out) or 'none'})"
            )
        if isinstance(value, str):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out:
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if not (0.0 <= lo <= 1.0 <= hi):
            raise LossInputError(
                f"need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {lo}, {hi}"
            )
    return out


def datum_loss(
    name: str, target_lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> Tensor:
    """The summed loss of one datum (a scalar with the graph of ``target_lp``).

    ``target_lp`` has the shape of ``target_tokens``: [N], or [N, K] for ``cross_entropy``'s
    top-K form, ``-sum_{t,k} w[t,k] * lp[t,k]`` (``weights`` [N, K]). Every other input must
    have that shape too; a key the loss does not read is refused (it would be ignored)."""
    n = target_lp.shape[0]
    wanted = BUILTIN_LOSSES[name]
    extra = sorted(set(inputs) - set(wanted))
    if extra:
        hint = (
            " (clip thresholds go in loss_fn_config)"
            if any(k.startswith("clip_") for k in extra)
            else ""
        )
        raise LossInputError(
            f"loss_fn {name!r} does not read loss_fn_inputs {extra}; it reads "
            f"{', '.join(wanted)}{hint}"
        )
    if target_lp.dim() != 1 and name != "cross_entropy":
        raise LossInputError(
            f"loss_fn {name!r} needs 1-D target_tokens (one per position); [N, K] targets "
            "are cross_entropy's"
        )
    for key in wanted:
        if key == "weights" and key not in inputs:
            continue
        if key not in inputs:
            raise LossInputError(f"loss_fn {name!r} needs loss_fn_inputs[{key!r}]")
        if inputs[key].shape != target_lp.shape:
            raise LossInputError(
                f"loss_fn_inputs[{key!r}] has shape {list(inputs[key].shape)}, the targets "
                f"{list(target_lp.shape)} (the model input has {n} tokens)"
            )
        if inputs[key].is_floating_point() and not bool(torch.isfinite(inputs[key]).all()):
            raise LossInputError(f"loss_fn_inputs[{key!r}] holds a non-finite value (nan or inf)")
    lp = target_lp.float()
    if name == "cross_entropy":
        w = inputs["weights"].float() if "weights" in inputs else torch.ones_like(lp)
        return -(w * lp).sum()
    q = inputs["logprobs"].float()
    adv = inputs["advantages"].float()
    if name == "importance_sampling":
        return -(torch.exp(lp - q) * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()
    eps_low = 1.0 - config["clip_low_threshold"]
    eps_high = config["clip_high_threshold"] - 1.0
    mask = torch.ones(1, n, dtype=torch.bool)
    norm = LossNorm("token-sum", float(n), 1.0)
    fn = ppo_clip_loss if name == "ppo" else cispo_loss
    loss, _ = fn(lp[None], q[None], adv[None], mask, norm, eps_low=eps_low, eps_high=eps_high)
    return loss

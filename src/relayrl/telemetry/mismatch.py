"""Train/inference mismatch monitor: how far the engine's behaviour logprobs are from the
trainer's logprobs of the same tokens, per training step, for every rollout backend.

Why: the decoupled / PPO objectives assume the behaviour logprob the engine reported is the
logprob the trainer would compute for that token under the same weights. A kernel, precision,
sampling-filter or weight-sync bug breaks that silently (the loss still goes down); the
peers' most common silent failure is a mismatch nobody measured. This module measures it.

Per step, over the trained tokens (response mask > 0) whose version equals the weights the
trainer scored them with (``versions == trainer_version``; all of them when no versions are
given: the sync schedule), it reports

- ``mismatch/mean_abs``: mean |behaviour logprob - trainer logprob|,
- ``mismatch/max_abs``: the largest such difference,
- ``mismatch/frac_over``: the fraction of those tokens whose difference exceeds ``threshold``,
- ``mismatch/tokens``: how many tokens were compared (stale tokens are left out: their
  difference is the policy change, not a mismatch),

and logs one warning (``logging`` logger ``relayrl.telemetry.mismatch``) when the mean jumps:
above ``jump_factor`` x the median of the previous ``window`` steps' means and above the
absolute floor ``min_mean`` (fp32 noise of 1e-7 -> 5e-7 is not a jump).

Only torch and the standard library: telemetry is a leaf layer.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

KEYS = ("mismatch/mean_abs", "mismatch/max_abs", "mismatch/frac_over", "mismatch/tokens")


@torch.no_grad()
def token_mismatch(
    behaviour: Tensor,
    trainer: Tensor,
    mask: Tensor,
    threshold: float,
    versions: Tensor | None = None,
    trainer_version: int | None = None,
) -> dict[str, float]:
    """The step's mismatch figures (``KEYS``) over masked, same-version tokens.

    ``behaviour``, ``trainer``, ``mask`` (and ``versions``) are [B, R] tensors of the same
    shape; ``trainer`` may carry autograd history (it is detached here).
    """
    if behaviour.shape != trainer.shape or behaviour.shape != mask.shape:
        raise ValueError(
            f"mismatch: behaviour {tuple(behaviour.shape)}, trainer {tuple(trainer.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    keep = mask > 0
    if versions is not None and trainer_version is not None:
        keep = keep & (versions == trainer_version)
    diff = (behaviour.detach().float() - trainer.detach().float()).abs()[keep]
    n = int(diff.numel())
    if n == 0:
        return {KEYS[0]: 0.0, KEYS[1]: 0.0, KEYS[2]: 0.0, KEYS[3]: 0.0}
    return {
        KEYS[0]: float(diff.mean()),
        KEYS[1]: float(diff.max()),
        KEYS[2]: float((diff > threshold).float().mean()),
        KEYS[3]: float(n),
    }


class MismatchMonitor:
    """Per-step mismatch figures with a warning when the mean jumps.

    Args:
        threshold: |difference| above which a token counts in ``mismatch/frac_over``.
        jump_factor: warn when the step's mean exceeds this many times the recent median.
        window: how many previous steps the median is taken over.
        min_mean: no warning while the step's mean is below this (numerical noise).
    """

    def __init__(
        self,
        threshold: float = 0.1,
        jump_factor: float = 5.0,
        window: int = 5,
        min_mean: float = 1e-3,
    ) -> None:
        if threshold <= 0:
            raise ValueError(f"mismatch threshold must be > 0, got {threshold}")
        if jump_factor <= 1:
            raise ValueError(f"mismatch jump_factor must be > 1, got {jump_factor}")
        if window < 1:
            raise ValueError(f"mismatch window must be >= 1, got {window}")
        self.threshold = threshold
        self.jump_factor = jump_factor
        self.min_mean = min_mean
        self._recent: deque[float] = deque(maxlen=window)
        self.warnings: list[str] = []

    def observe(
        self,
        behaviour: Tensor,
        trainer: Tensor,
        mask: Tensor,
        versions: Tensor | None = None,
        trainer_version: int | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Measure one step; returns the metrics to log (``KEYS``) and warns on a jump."""
        out = token_mismatch(behaviour, trainer, mask, self.threshold, versions, trainer_version)
        mean = out[KEYS[0]]
        if out[KEYS[3]] == 0:
            return out
        if self._recent and mean >= self.min_mean:
            median = statistics.median(self._recent)
            if mean > self.jump_factor * max(median, 1e-12):
                where = f"step {step}: " if step is not None else ""
                msg = (
                    f"{where}train/inference logprob mismatch jumped: mean |behaviour - trainer| "
                    f"= {mean:.3g} (median of the last {len(self._recent)} steps "
                    f"{median:.3g}), max {out[KEYS[1]]:.3g}, {out[KEYS[2]]:.1%} of "
                    f"{int(out[KEYS[3]])} tokens over {self.threshold:g}"
                )
                self.warnings.append(msg)
                log.warning(msg)
        self._recent.append(mean)
        return out

    def observe_experience(
        self,
        exp: Any,
        compute_logprobs: Callable[[Any], Tensor],
        trainer_version: int | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """``observe`` on a training batch (a ``relayrl.workers.Experience``): its
        ``behaviour_logprobs``, ``response_mask`` and ``versions`` against its ``old_logprobs``
        when the step recomputed them (the pre-update actor's), else ``compute_logprobs(exp)``
        (one extra forward: the default single-update sync step has no recompute)."""
        trainer = exp.old_logprobs if exp.old_logprobs is not None else compute_logprobs(exp)
        return self.observe(
            exp.behaviour_logprobs, trainer, exp.response_mask, exp.versions, trainer_version, step
        )

"""The ``failures`` section: how infrastructure failures are retried, left out and budgeted
(``relayrl.controller.failures``, docs/failures.md).

An infrastructure failure (an environment that raises or hangs, a reward function that raises,
a reward worker that dies or times out, an agent that crashes, an engine that aborts a turn) is
never training data: the sample is generated and scored again up to ``retries`` times, and what
still fails is left out of the batch and of its group's statistics. A run
whose failures pass a budget stops with one line (exit 1).
"""

from __future__ import annotations

from pydantic import Field

from relayrl.config.base import _Strict


class FailuresConfig(_Strict):
    retries: int = Field(2, ge=0)
    """Times a sample that failed for infrastructure reasons is generated and scored again
    (same request, same seed, a fresh environment) before it is left out (every schedule and
    the held-out evaluation)."""
    regenerate_rounds: int = Field(2, ge=0)
    """A group left with fewer than 2 samples after retries (GRPO-style estimators) is replaced
    by a fresh prompt's group as dynamic sampling refills: ``sync``, in up to this many rounds
    per step; ``async`` / ``overlap``, up to this many x ``prompts_per_step`` groups per trainer
    version. One still too small after them is dropped (0: drop at once). With
    ``data.dynamic_sampling.enabled`` dynamic sampling's own refill does this."""
    max_consecutive: int = Field(64, ge=1)
    """Stop the run after this many infrastructure failures in a row (samples, after retries)."""
    max_rate: float = Field(0.5, gt=0, le=1)
    """Stop the run when more than this fraction of the last ``window`` samples failed."""
    window: int = Field(256, ge=1)
    """Samples over which ``max_rate`` is measured (checked once that many were seen)."""
    stall_s: float | None = Field(600.0, gt=0)
    """Seconds a rollout may go without progress before it is an error naming what is stuck
    (null: wait for ever). ``sync`` (and ``--rollout-only``): no phase of the step began (its
    generation, scoring, a retry, a regenerated group) and neither the engine's generated tokens
    nor the reward role's scored samples grew; ``async`` / ``overlap``: the trainer waits while
    no sample finished generating or scoring."""

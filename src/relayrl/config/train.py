"""The ``train`` section: steps, checkpoints and the run's length."""

from __future__ import annotations

from pydantic import Field

from relayrl.config.base import (
    _Strict,
)


class TrainConfig(_Strict):
    steps: int = Field(400, ge=1)
    """Training steps (the last one is always checkpointed)."""
    eval_every: int = Field(0, ge=0)
    """Greedy held-out eval every N steps (0: only before and after)."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    save_on_signal: bool = True
    """On SIGINT / SIGTERM, checkpoint the last completed step before stopping (a signal during
    a step's weight update waits for the end of that step; a second one stops at once)."""
    save_trajectories: bool = False
    """Append every trained trajectory of each step to ``<run_dir>/trajectories.jsonl``
    (token ids, loss mask, behaviour logprobs, versions, score, text, episode info:
    ``relayrl.env.export``); ``relayrl report`` summarises it."""

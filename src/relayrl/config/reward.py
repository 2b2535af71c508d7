"""The ``reward`` section: the reward function and the reward service."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from relayrl.config.base import (
    _Strict,
)


class RewardFnConfig(_Strict):
    """One weighted reward function of a mixture."""

    fn: str
    weight: float = 1.0
    """Any finite number (a negative weight makes the component a penalty)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    name: str | None = None


class RewardServiceConfig(_Strict):
    """The reward service (``relayrl.reward.service``): mixture, workers, timeouts."""

    functions: list[RewardFnConfig] = Field(default_factory=list)
    """Weighted mixture of reward functions; when set it replaces ``reward.fn``."""
    outcome: str | None = None
    """Component that is the verifiable outcome (pass rate, dynamic sampling); default first."""
    num_workers: int = Field(0, ge=0)
    """Worker processes for rule-based rewards (0: score inline, without timeouts)."""
    timeout_s: float = Field(30.0, gt=0)
    max_pending: int | None = Field(None, ge=1)
    failure_score: float = 0.0
    normalize: Literal["none", "domain_zscore"] = "none"
    """``domain_zscore``: z-score the mixed score within each batch, per domain (``schedule:
    sync`` only: overlap and async score each sample as it finishes)."""
    domain_key: str = "domain"
    worker_max_calls: int | None = Field(5000, ge=1)
    """Replace a reward worker after this many calls (null: never)."""
    worker_max_rss_mb: float | None = Field(1024.0, gt=0)
    """Replace a reward worker whose resident memory exceeds this after a call (null: never)."""
    max_components: int = Field(64, ge=1)
    """Most components a sample's reward may have; more is a recorded failure."""


class RewardConfig(_Strict):
    fn: str = "arithmetic"
    """A registered reward function name or an import path ``module:function``; ``none``
    with ``model_path`` set scores with the reward model alone."""
    model_path: str | None = None
    """A reward model (``relayrl rm`` output); score = fn score + model_weight * RM score."""
    model_weight: float = 1.0
    model_batch_size: int = Field(64, ge=1)
    model_normalize: bool = True
    """Use the RM score normalised to mean 0, std 1 on its training completions."""
    fn_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one inline call of ``fn`` may take (null: no limit). A call past it ends the run
    in one line after checkpointing the last completed step (the reward service's workers have
    their own ``service.timeout_s``)."""
    service: RewardServiceConfig = Field(default_factory=RewardServiceConfig)

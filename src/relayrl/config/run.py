"""A whole RL run: every section in one object (``RunConfig``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.algo import AlgoConfig
from relayrl.config.asynchronous import AsyncConfig
from relayrl.config.base import (
    KeyProblem,
    Seed,
    Threads,
    _Strict,
)
from relayrl.config.data import DataConfig
from relayrl.config.env import EnvConfig
from relayrl.config.eval import EvalConfig
from relayrl.config.failures import FailuresConfig
from relayrl.config.logging import LoggingConfig
from relayrl.config.model import ModelConfig
from relayrl.config.monitor import MonitorConfig
from relayrl.config.optim import OptimConfig
from relayrl.config.ray import RayConfig
from relayrl.config.reward import RewardConfig
from relayrl.config.rollout import RolloutConfig
from relayrl.config.train import TrainConfig
from relayrl.config.weight_sync import WeightSyncConfig


class RunConfig(_Strict):
    """A whole RL run."""

    seed: Seed = 0
    run_dir: str = "runs/grpo"
    threads: Threads = "auto"
    """torch intra-op threads of this process (one per process when several share the CPU);
    ``auto``: the idle CPUs at start, less ``rollout.threads`` when the engine has its own
    process."""
    schedule: Literal["sync", "overlap", "async"] = "sync"
    """``sync``: generate then train, one process. ``overlap``: one-step off-policy, engine in
    its own process. ``async``: continuous generation under the staleness gate (``async_``)."""
    cluster: Literal["local", "ray"] = "local"
    ray: RayConfig = Field(default_factory=RayConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    failures: FailuresConfig = Field(default_factory=FailuresConfig)
    """Infrastructure failures: retries, the budgets that stop a sick run, the async stall
    limit (docs/failures.md)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        ds = self.data.dynamic_sampling
        if ds.enabled and self.algo.name != "dpo" and self.algo.group_size < 2:
            raise KeyProblem(
                "data.dynamic_sampling.enabled",
                True,
                "dynamic sampling drops groups whose outcomes are all equal, so it needs "
                f"algo.group_size >= 2 (got {self.algo.group_size}: every group would be dropped)",
                related=("algo.group_size",),
            )
        if self.schedule != "sync" and self.reward.service.normalize == "domain_zscore":
            raise KeyProblem(
                "reward.service.normalize",
                "domain_zscore",
                f"domain_zscore z-scores a step's batch at once, but schedule {self.schedule} "
                "scores each sample as it finishes, so the z-score would never be applied; "
                "use schedule: sync, or normalize: none",
                related=("schedule",),
            )
        return self

    @property
    def policy_loss(self) -> str:
        """Off-policy correction is on whenever data can be stale."""
        if self.algo.policy_loss is not None:
            return self.algo.policy_loss
        return "ppo" if self.schedule == "sync" else "decoupled_ppo"

    @property
    def staleness_eta(self) -> int | None:
        return 1 if self.schedule == "overlap" else self.async_.eta

    @property
    def interrupt(self) -> bool:
        return False if self.schedule == "overlap" else self.async_.interrupt

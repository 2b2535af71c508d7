"""The ``ray`` section: pools, bundles and placement across machines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import (
    KeyProblem,
    _Strict,
)


class RayPoolConfig(_Strict):
    """One resource pool: a Ray placement group of ``bundles`` equal bundles (one worker
    process per bundle), packed on as few nodes as possible or spread over nodes."""

    bundles: int = Field(1, ge=1)
    cpus_per_bundle: float = Field(1.0, gt=0)
    gpus_per_bundle: float = Field(0.0, ge=0)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class RayConfig(_Strict):
    """``cluster: ray``: where each role runs. Roles mapped to the same pool are colocated
    (they share the pool's processes and time-share its devices); roles on different pools
    run concurrently. The reward role runs in the controller process."""

    address: str | None = None
    """Address of a running cluster (``auto``, ``ray://host:10001``, ``host:6379``);
    null: start a local cluster on demand (or use the one this process already joined)."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local cluster started on demand (null: all)."""
    pools: dict[str, RayPoolConfig] = Field(default_factory=lambda: {"main": RayPoolConfig()})
    placement: dict[str, str] = Field(default_factory=dict)
    """role -> pool name, for ``actor``, ``reference``, ``critic``, ``rollout``; a role not
    named goes to the first pool."""
    rollout_replicas: int = Field(1, ge=1)
    """Rollout engines (one per bundle of the rollout pool when it is not colocated)."""
    max_replica_restarts: int = Field(3, ge=0)
    """How often a dead rollout replica is restarted before the run fails."""

    @model_validator(mode="after")
    def _placement_names_pools(self) -> RayConfig:
        for role, pool in self.placement.items():
            if role not in ("actor", "reference", "critic", "rollout"):
                raise KeyProblem(
                    "placement",
                    self.placement,
                    f"unknown role {role!r} (roles: actor, reference, critic, rollout)",
                )
            if pool not in self.pools:
                raise KeyProblem(
                    f"placement.{role}", pool, f"unknown pool {pool!r} (pools: {list(self.pools)})"
                )
        return self

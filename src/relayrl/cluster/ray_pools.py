"""Resource pools on Ray placement groups, and the role -> pool mapping (HybridFlow).

A pool is a placement group of equal bundles (CPUs and/or GPUs); each bundle hosts one
worker process of the pool. Roles mapped to the same pool are *colocated*: they live in the
same processes and time-share the devices. Roles on different pools run concurrently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from relayrl.config import RayConfig, RayPoolConfig

ROLES = ("actor", "reference", "critic", "rollout")


def ensure_ray(cfg: RayConfig) -> None:
    """Join ``cfg.address`` or start a local cluster on demand (no-op when already joined)."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if cfg.address is not None:
        ray.init(address=cfg.address, **kwargs)
    else:  # a cluster of this run's own, even when another runs on this machine
        ray.init(address="local", num_cpus=cfg.num_cpus, **kwargs)


@dataclass
class ResourcePool:
    """A placement group of ``spec.bundles`` bundles, created (and awaited) on construction."""

    name: str
    spec: RayPoolConfig
    timeout_s: float = 120.0
    pg: PlacementGroup = field(init=False)

    def __post_init__(self) -> None:
        bundle: dict[str, float] = {"CPU": self.spec.cpus_per_bundle}
        if self.spec.gpus_per_bundle > 0:
            bundle["GPU"] = self.spec.gpus_per_bundle
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.spec.bundles)],
            strategy=self.spec.strategy,
            name=f"relayrl-{self.name}-{os.getpid()}",
        )
        ready, _ = ray.wait([self.pg.ready()], timeout=self.timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"ray pool {self.name!r}: {self.spec.bundles} bundles of {bundle} could not be "
                f"placed within {self.timeout_s:.0f} s (cluster resources: "
                f"{ray.cluster_resources()})"
            )

    @property
    def size(self) -> int:
        return self.spec.bundles

    def options(self, rank: int) -> dict[str, Any]:
        """``.options(...)`` for a worker process on bundle ``rank`` (it takes the bundle)."""
        return {
            "num_cpus": self.spec.cpus_per_bundle,
            "num_gpus": self.spec.gpus_per_bundle,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            ),
        }

    def remove(self) -> None:
        remove_placement_group(self.pg)


def alive_nodes() -> list[dict[str, float]]:
    """The resources of each live node of the joined cluster."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive", True)]


def role_pools(cfg: RayConfig, roles: list[str]) -> dict[str, list[str]]:
    """pool name -> the roles placed on it (roles not named in ``cfg.placement`` go to the
    first pool); only pools that get a role are listed."""
    first = next(iter(cfg.pools))
    out: dict[str, list[str]] = {}
    for role in roles:
        out.setdefault(cfg.placement.get(role, first), []).append(role)
    return out


def create_pools(cfg: RayConfig, names: list[str]) -> dict[str, ResourcePool]:
    """Create the named pools' placement groups (removing the ones made so far on failure)."""
    pools: dict[str, ResourcePool] = {}
    try:
        for name in names:
            pools[name] = ResourcePool(name, cfg.pools[name])
    except BaseException:
        for p in pools.values():
            p.remove()
        raise
    return pools

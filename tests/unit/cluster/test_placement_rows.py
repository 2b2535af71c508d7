"""A trainer pool with more ranks than a step has sequences is refused before Ray starts, with
one line naming the keys (``relayrl.cluster.placement_check``): its extra ranks would never
get a row (a step that drops below the pool's size mid-run still trains: see
tests/integration/test_small_batches_ranks.py)."""

from __future__ import annotations

import pytest

from relayrl.cluster.placement_check import check_placement
from relayrl.config import ConfigError, RunConfig, load_config

pytest.importorskip("ray")


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["cluster=ray", *overrides])


def _by_pool(cfg: RunConfig) -> dict[str, list[str]]:
    from relayrl.cluster.ray_pools import role_pools
    from relayrl.cluster.ray_roles import needed_roles

    return role_pools(cfg.ray, needed_roles(cfg))


def test_more_trainer_ranks_than_sequences_per_step_is_refused():
    cfg = _cfg(
        "ray.pools={trainer: {bundles: 4}}",
        "algo.prompts_per_step=1",
        "algo.group_size=3",
        "algo.mini_batches=1",
    )
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, _by_pool(cfg))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("ray.pools.trainer.bundles=4")
    assert "algo.prompts_per_step * algo.group_size = 1 x 3" in msg


def test_as_many_ranks_as_sequences_and_a_separate_rollout_pool_pass():
    cfg = _cfg(
        "ray.pools={trainer: {bundles: 3}, gen: {bundles: 4}}",
        "ray.placement={actor: trainer, rollout: gen}",
        "ray.rollout_replicas=4",
        "algo.prompts_per_step=1",
        "algo.group_size=3",
        "algo.mini_batches=1",
    )
    check_placement(cfg, _by_pool(cfg))  # the rollout pool's 4 replicas split nothing


def test_a_trainer_group_without_gpus_on_a_gpu_cluster_is_refused_unless_on_the_cpu():
    """Ray reserves no GPU for a ``gpus_per_bundle: 0`` pool: its ranks would pick
    ``cuda:<rank % count>`` themselves and can land two on one GPU."""
    pools = "ray.pools={trainer: {bundles: 2, cpus_per_bundle: 1}}"
    gpu_cluster = ({"CPU": 16.0, "GPU": 16.0}, [{"CPU": 8, "GPU": 8}] * 2)
    cfg = _cfg(pools, "model.fsdp.enabled=true")
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, _by_pool(cfg), *gpu_cluster)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("ray.pools.trainer.gpus_per_bundle=0: the cluster has 16 GPUs")
    check_placement(cfg, _by_pool(cfg), {"CPU": 16.0}, [{"CPU": 8}] * 2)  # a CPU cluster
    cpu = _cfg(pools, "model.fsdp.enabled=true", "model.device=cpu")
    check_placement(cpu, _by_pool(cpu), *gpu_cluster)
    gpu = _cfg(
        "ray.pools={trainer: {bundles: 2, cpus_per_bundle: 1, gpus_per_bundle: 1}}",
        "model.fsdp.enabled=true",
    )
    check_placement(gpu, _by_pool(gpu), *gpu_cluster)

"""Placement that refuses what cannot work, with one line naming the keys, before anything
starts (``relayrl.cluster.placement_check``; no Ray cluster needed)."""

from __future__ import annotations

import pytest

from relayrl.cluster.placement_check import check_placement, weight_backend
from relayrl.config import ConfigError, RunConfig, load_config

SPLIT = "ray.placement={actor: trainer, rollout: gen}"


def _cfg(pools: str, *overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["cluster=ray", f"ray.pools={pools}", *overrides])


def _by_pool(cfg: RunConfig) -> dict[str, list[str]]:
    from relayrl.cluster.ray_pools import role_pools
    from relayrl.cluster.ray_roles import needed_roles

    return role_pools(cfg.ray, needed_roles(cfg))


def _refusal(cfg: RunConfig, cluster=None, nodes=()) -> str:
    pytest.importorskip("ray")
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, _by_pool(cfg), cluster, nodes)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_fractional_gpus_for_trainer_ranks_are_refused():
    cfg = _cfg("{trainer: {bundles: 2, gpus_per_bundle: 0.5}, gen: {bundles: 1}}", SPLIT)
    msg = _refusal(cfg)
    assert msg.startswith("ray.pools.trainer.gpus_per_bundle=0.5")
    assert "NCCL" in msg


def test_fractional_gpus_are_fine_for_one_rank_and_for_rollout_replicas():
    pytest.importorskip("ray")
    one = _cfg("{trainer: {bundles: 1, gpus_per_bundle: 0.5}, gen: {bundles: 1}}", SPLIT)
    check_placement(one, _by_pool(one))
    gen = _cfg(
        "{trainer: {bundles: 2, gpus_per_bundle: 1}, gen: {bundles: 2, gpus_per_bundle: 0.5}}",
        SPLIT,
        "ray.rollout_replicas=2",
    )
    check_placement(gen, _by_pool(gen))


def test_nccl_weight_sync_to_a_pool_without_gpus_is_refused_and_auto_picks_gloo():
    pools = "{trainer: {bundles: 1, gpus_per_bundle: 1}, gen: {bundles: 1}}"
    cfg = _cfg(pools, SPLIT, "weight_sync.transport=collective", "weight_sync.backend=nccl")
    msg = _refusal(cfg)
    assert msg.startswith("weight_sync.backend=nccl: the rollout pool 'gen' has no GPUs")
    assert "ray.pools.gen.gpus_per_bundle=0" in msg
    auto = _cfg(pools, SPLIT, "weight_sync.transport=collective")
    assert weight_backend(auto, trainer_on_cuda=True) == "gloo"
    gpus = "{trainer: {bundles: 1, gpus_per_bundle: 1}, gen: {bundles: 1, gpus_per_bundle: 1}}"
    assert weight_backend(_cfg(gpus, SPLIT), trainer_on_cuda=True) == "nccl"
    assert weight_backend(_cfg(gpus, SPLIT), trainer_on_cuda=False) == "gloo"


def test_pools_that_do_not_fit_the_cluster_are_refused():
    cfg = _cfg("{trainer: {bundles: 4, gpus_per_bundle: 1}, gen: {bundles: 2}}", SPLIT)
    nodes = [{"CPU": 8.0, "GPU": 2.0}]
    msg = _refusal(cfg, {"CPU": 8.0, "GPU": 2.0}, nodes)
    assert msg.startswith("the pools need 4 GPUs (ray.pools.trainer.bundles x gpus_per_bundle")
    packed = _cfg(
        "{trainer: {bundles: 2, gpus_per_bundle: 1, strategy: STRICT_PACK}, gen: {bundles: 1}}",
        SPLIT,
    )
    two_nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    msg = _refusal(packed, {"CPU": 8.0, "GPU": 2.0}, two_nodes)
    assert msg.startswith("ray.pools.trainer: its bundles together (STRICT_PACK)")
    check_placement(packed, _by_pool(packed), {"CPU": 8.0, "GPU": 2.0}, [{"CPU": 8, "GPU": 2}])


def test_more_replicas_than_rollout_bundles_are_refused():
    cfg = _cfg("{trainer: {bundles: 1}, gen: {bundles: 1}}", SPLIT, "ray.rollout_replicas=2")
    assert _refusal(cfg).startswith("ray.rollout_replicas=2: pool 'gen'")

"""``cluster: ray`` configuration: pools, placement and its errors (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from relayrl.config import ConfigError, RunConfig, load_config

pytest.importorskip("ray")

from relayrl.cluster.ray_pools import role_pools  # noqa: E402
from relayrl.cluster.ray_roles import needed_roles  # noqa: E402


def _cfg(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["cluster=ray", *overrides])


def test_default_is_all_roles_colocated_on_one_pool():
    cfg = _cfg("algo.name=ppo")
    assert role_pools(cfg.ray, needed_roles(cfg)) == {
        "main": ["actor", "rollout", "reference", "critic"]
    }


def test_split_placement_gives_the_rollout_its_own_pool():
    cfg = _cfg(
        "ray.pools={trainer: {bundles: 2}, rollout: {bundles: 3, cpus_per_bundle: 0.5}}",
        "ray.placement={actor: trainer, rollout: rollout}",
        "algo.kl_coef=0.1",
    )
    assert role_pools(cfg.ray, needed_roles(cfg)) == {
        "trainer": ["actor", "reference"],  # not named: the first pool
        "rollout": ["rollout"],
    }


@pytest.mark.parametrize(
    "override,match",
    [
        ("ray.placement={actor: nowhere}", "unknown pool 'nowhere'"),
        ("ray.placement={critc: main}", "unknown role 'critc'"),
        ("ray.pools={main: {bundles: 0}}", "bundles"),
        ("cluster=slurm", "cluster"),
    ],
)
def test_bad_ray_config_names_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(override)

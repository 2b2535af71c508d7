"""A two-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``): the
trainer pool and the rollout pool land on different nodes, weights cross nodes through the
object store, and the async schedule runs unchanged."""

from __future__ import annotations

import json
import os

import pytest

from helpers import run_config

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.controller.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_roles_are_placed_on_both_nodes(sft_model, tmp_path, two_nodes):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    cfg = run_config(
        sft_model,
        tmp_path / "two",
        "cluster=ray",
        f"ray.address={two_nodes.address}",
        "schedule=async",
        "train.steps=4",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=16",
        # one CPU per node: each one-CPU pool fills a node
        "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 1}}",
        "ray.placement={actor: trainer, reference: trainer, rollout: rollout}",
    )
    where = []

    def build(a, c):
        roles = build_ray_roles(cfg, a, c)
        where.append(ray.get(roles.actor.group.hosts[0].ready.remote()))
        where.append(ray.get(roles.rollout.replica(0).ready.remote()))
        return roles

    out = train(cfg, build)
    trainer, rollout = where
    assert trainer["node_id"] != rollout["node_id"]
    assert {trainer["node_id"], rollout["node_id"]} == {
        n["NodeID"] for n in ray.nodes() if n["Alive"]
    }
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward_mean" in r]) == 4
    assert out["engine"]["weight_updates"] >= 4 and out["engine"]["weight_sync_s"] > 0

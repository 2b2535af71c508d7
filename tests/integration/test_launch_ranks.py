"""The multi-rank launch path a first GPU-cluster run goes through, on the CPU:

* each Ray worker of a GPU pool computes on the GPU Ray assigned to it, not on ``cuda:<pool
  rank>`` (a real local Ray cluster that declares 2 GPUs; the worker reads its assignment and
  ``CUDA_VISIBLE_DEVICES`` as ``RoleHost`` does), with and without
  ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``;
* the statistics the worker group logs for an update of 2 ranks (``gather`` of each rank's
  dict) are the whole batch's: token-weighted means over both shards, not the mean of the
  ranks' means (float64, 2 gloo ranks on uneven shards vs one process, within 1e-12);
* a sharded (FSDP2) checkpoint resumes at another world size (2 -> 1 and 1 -> 2 ranks): the
  next step gives the weights the writing ranks reach (float64, within 1e-12);
* two rollout replicas sample a group's requests apart and each request alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from launch_ranks import actor_stats, critic_stats, rank_main, reshard_main
from ray_local import ray_local
from relayrl.model import build_tiny_model

TOL = 1e-12


@pytest.fixture(scope="module")
def two_rank_stats(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_ranks")
    model = build_tiny_model(root / "m", hidden_size=16)
    rendezvous = str(root / "rendezvous")
    mp.spawn(rank_main, args=(2, rendezvous, str(model), str(root)), nprocs=2, join=True)
    return model, torch.load(root / "stats.pt", weights_only=False)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_two_rank_statistics_equal_one_process(two_rank_stats, role, fsdp):
    from relayrl.cluster.ray_workers import gather

    model, got = two_rank_stats
    one = {"actor": actor_stats, "critic": critic_stats}[role](model, 0, 0, fsdp=False)
    logged = gather(got[(role, fsdp)])
    assert logged.keys() == one.keys()
    diffs = {k: abs(logged[k] - one[k]) for k in one}
    assert max(diffs.values()) < TOL, diffs
    # every rank returns the global means (its own shard's differ: 5 + 3 rows)
    means = "actor/entropy" if role == "actor" else "critic/vpred_mean"
    r0, r1 = (s[means] for s in got[(role, fsdp)])
    assert r0 == r1 == logged[means]


@pytest.mark.parametrize("noset", [False, True], ids=["ray-sets-visible", "noset"])
def test_each_ray_rank_of_a_gpu_pool_uses_its_assigned_gpu(noset):
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def assigned_device(rank: int) -> tuple[str, int, str]:
        """(the GPU Ray assigned to pool rank ``rank``, the index ``RoleHost`` computes, the
        physical GPU that index names)."""
        import os

        import ray

        from relayrl.model.device import local_cuda_index

        ids = [str(i) for i in ray.get_gpu_ids()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = len(visible.split(",")) if visible is not None else 3  # the node's 3 GPUs
        index = local_cuda_index(rank, count, ids, visible)
        physical = visible.split(",")[index] if visible is not None else str(index)
        return ids[0], index, physical

    env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}} if noset else {}
    with ray_local(num_gpus=3, runtime_env=env, log_to_driver=True):
        # another pool holds a GPU, so the trainer pool's ranks 0, 1 are not on GPUs 0, 1
        other = placement_group([{"CPU": 0.5, "GPU": 1}], strategy="PACK")
        ray.get(other.ready(), timeout=60)
        hold = ray.remote(assigned_device).options(
            num_cpus=0.5, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(other, 0)
        )
        held = ray.get(hold.remote(0), timeout=120)[0]
        pg = placement_group([{"CPU": 0.5, "GPU": 1}] * 2, strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        probe = ray.remote(assigned_device)
        got = ray.get(
            [
                probe.options(
                    num_cpus=0.5,
                    num_gpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i),
                ).remote(i)
                for i in range(2)
            ],
            timeout=120,
        )
        remove_placement_group(pg)
        remove_placement_group(other)
    assert len({a for a, _, _ in got} | {held}) == 3  # Ray gave each rank a GPU of its own
    for assigned, index, physical in got:
        assert physical == assigned  # each rank computes on its own GPU
        assert index == (int(assigned) if noset else 0)


def test_two_replicas_sample_a_group_apart_and_a_request_alike(tmp_path):
    """Rollout seeding over replicas: the engines of two Ray replicas are built alike (no
    per-replica seed, as ``RoleHost`` builds them), and every request carries its own seed
    from (run seed, step, prompt index, k) (``group_requests``): a group's G samples differ
    from each other, and a request gives the same tokens on either replica, so where the
    rollout client sends it does not change the run."""
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.algorithms import group_requests
    from relayrl.data.prompts.tokens import TokenizedPrompt
    from relayrl.data.records import PromptRecord
    from relayrl.model import load_causal_lm
    from relayrl.rollout import RolloutEngine

    path = build_tiny_model(tmp_path / "m", hidden_size=16)
    cfg = load_config(
        RunConfig,
        None,
        [f"model.path={path}", "algo.group_size=4", "rollout.max_tokens=6", "seed=3"],
    )
    prompt = TokenizedPrompt(PromptRecord("p"), [5, 6, 7])

    def replica() -> RolloutEngine:
        model = load_causal_lm(path).eval().requires_grad_(False)
        return RolloutEngine(model, eos_token_id=1, pad_token_id=0, max_slots=4)

    def run(engine: RolloutEngine, step: int, index: int) -> list[tuple[int, ...]]:
        for req in group_requests(prompt, cfg, step, index, index, []):
            engine.submit(req)
        done = []
        while engine.has_unfinished():
            done.extend(engine.step())
        by_k = sorted(done, key=lambda s: s.metadata["sample_index"])
        return [tuple(s.response_ids) for s in by_k]

    a, b = replica(), replica()
    group = run(a, step=0, index=0)
    assert len(set(group)) == len(group) == 4  # G different samples of one prompt
    assert run(b, step=0, index=0) == group  # the same requests on the other replica
    assert run(b, step=0, index=1) != group  # the next prompt slot: other seeds


@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, saved, loaded):
    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    ckpt, want, got = tmp_path / "ckpt", tmp_path / "want.pt", tmp_path / "got.pt"
    for world, out, save in ((saved, want, True), (loaded, got, False)):
        init = str(tmp_path / f"rendezvous_{save}")
        args = (world, init, str(model), str(ckpt), str(out), save)
        mp.spawn(reshard_main, args=args, nprocs=world, join=True)
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(saved)]
    a, b = torch.load(want), torch.load(got)
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < TOL


def test_the_multi_node_command_runs_fsdp2_across_two_nodes_and_resumes_on_one_rank(tmp_path):
    """docs/guide.md's multi-node command (``relayrl train run.yaml cluster=ray
    ray.address=...``) on a 2-node Ray cluster simulated here: an FSDP2 pool of 2 ranks, one
    per node (``STRICT_SPREAD``: the process group's rendezvous crosses nodes), 2 steps and a
    checkpoint; then ``--resume`` on one rank (the sharded checkpoint resharded) for step 3."""
    import json
    import os

    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from relayrl.cli import main

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    model = build_tiny_model(tmp_path / "m")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        common = [
            str(Path(__file__).parents[2] / "configs/grpo_arithmetic.yaml"),
            "cluster=ray",
            f"ray.address={cluster.address}",
            f"model.path={model}",
            f"run_dir={tmp_path / 'run'}",
            "model.fsdp.enabled=true",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "algo.prompts_per_step=4",
            "algo.group_size=2",
            "algo.mini_batches=1",
            "data.eval_size=4",
            "train.eval_every=0",
            "train.save_every=2",
            "rollout.max_tokens=4",
        ]
        spread = "ray.pools={main: {bundles: 2, cpus_per_bundle: 1, strategy: STRICT_SPREAD}}"
        assert main(["train", *common, "train.steps=2", spread]) == 0
        ray.shutdown()
        one = "ray.pools={main: {bundles: 1, cpus_per_bundle: 1}}"
        assert main(["train", *common, "train.steps=3", one, "--resume"]) == 0
    finally:
        ray.shutdown()
        cluster.shutdown()
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in (ckpts / "step_000002/sharded_actor").glob("rank_*.pt")) == [
        "rank_0.pt",
        "rank_1.pt",
    ]
    assert (ckpts / "step_000003/sharded_actor/rank_0.pt").is_file()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x).get("step") for x in lines if "actor/loss" in json.loads(x)]
    assert steps == [1, 2, 3]

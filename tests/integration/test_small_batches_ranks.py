"""A step whose batch has fewer sequences than data-parallel ranks (dynamic sampling or
filtering dropped groups mid-run), or whose mini-batches leave a rank without rows, trains on
what there is: the rank without rows still joins every collective (FSDP2: zero-weighted dummy
forwards / backwards; replicated: a zero gradient in the all-reduce), and 2 ranks (gloo,
float64, tiny model) end with one process's weights to 1e-9, actor and critic: a batch of
1 sequence over 2 ranks, and of 3 sequences in 2 mini-batches over 2 ranks, 2 epochs, 2 steps;
the same through the worker group of ``cluster=ray`` (``split_experience``, ``gather``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from ray_local import ray_local
from relayrl.model import build_tiny_model, pack_batch
from relayrl.workers import Experience
from relayrl.workers.data_parallel import split_experience
from small_batch_ranks import CASES, run_case

TOL = 1e-9
MODES = pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
SIZES = pytest.mark.parametrize("case", CASES, ids=["1row", "3rows_2mini"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("small") / "m", hidden_size=16)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    from small_batch_ranks import rank_main

    root = tmp_path_factory.mktemp("small_ranks")
    rendezvous = str(root / "rendezvous")
    mp.spawn(rank_main, args=(2, rendezvous, str(model_dir), str(root)), nprocs=2, join=True)
    return torch.load(root / "small.pt", weights_only=False)


@pytest.fixture(scope="module")
def one_process(model_dir):
    return {case: run_case(model_dir, 0, 0, False, case) for case in CASES}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_split_gives_the_last_ranks_empty_blocks():
    exp = Experience(pack_batch([[1]] * 3, [[2, 3]] * 3, pad_id=0))
    assert [len(b) for b in split_experience(exp.select([0]), 2)] == [1, 0]
    assert [len(b) for b in split_experience(exp, 2)] == [2, 1]
    assert [len(b) for b in split_experience(exp, 4)] == [1, 1, 1, 0]
    empty = split_experience(exp.select([0]), 2)[1]
    assert empty.response_mask.shape == (0, 2)


def test_scatter_tokens_of_no_rows_and_no_parts():
    exp = Experience(pack_batch([[1]] * 2, [[2, 3]] * 2, pad_id=0))
    out = exp.select([]).scatter_tokens([], torch.float64)
    assert out.shape == (0, 2) and out.dtype == torch.float64
    with pytest.raises(ValueError, match="no micro-batch outputs"):
        exp.scatter_tokens([])


@MODES
@SIZES
def test_weights_equal_one_process(two_ranks, one_process, model_dir, fsdp, case):
    from transformers import AutoModelForCausalLM

    got, one = two_ranks[(fsdp, case)], one_process[case]
    assert _max_diff(got["actor"], one["actor"]) < TOL
    assert _max_diff(got["critic"], one["critic"]) < TOL
    # the step trained (it was not skipped): the actor's weights moved
    init = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).state_dict()
    shared = init.keys() & got["actor"].keys()
    assert shared
    assert _max_diff({k: got["actor"][k] for k in shared}, {k: init[k] for k in shared}) > 1e-6


@MODES
@SIZES
def test_a_rank_had_no_rows(two_ranks, case, fsdp):
    """The case under test happened: some rank's part of some mini-batch was empty (with 1
    row, rank 1's whole block)."""
    ranks = two_ranks[(fsdp, case)]["ranks"]
    empty_parts = sum(size == 0 for r in ranks for draw in r["parts"] for size in draw)
    assert empty_parts > 0
    if case[0] == 1:
        assert all(lp.shape[0] == 0 for lp in ranks[1]["logprobs"])


@MODES
@SIZES
def test_logprobs_values_and_stats_equal_one_process(two_ranks, one_process, fsdp, case):
    from relayrl.cluster.ray_workers import gather

    ranks, one = two_ranks[(fsdp, case)]["ranks"], one_process[case]
    for key in ("logprobs", "values"):
        for step in range(2):
            joined = gather([r[key][step] for r in ranks])  # the worker group's gather
            assert joined.dtype == torch.float64
            torch.testing.assert_close(joined, one[key][step], rtol=0, atol=TOL)
    for key in ("actor_stats", "critic_stats"):
        for step in range(2):
            joined = gather([r[key][step] for r in ranks])
            assert joined.keys() == one[key][step].keys()
            for k, v in one[key][step].items():
                assert joined[k] == pytest.approx(v, abs=1e-9), k


@MODES
def test_ray_worker_group_trains_a_batch_smaller_than_its_pool(model_dir, tmp_path, fsdp):
    """Through the worker group of ``cluster=ray`` (2 Ray actors, gloo): a step of 1 sequence
    and one of 3 sequences in 2 mini-batches are split over the 2 ranks (rank 1 gets no rows
    of the first), trained, and the actor's and critic's weights are one process's."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    pytest.importorskip("ray")
    from helpers import run_config
    from relayrl.cluster.ray_roles import build_ray_roles
    from relayrl.model import load_causal_lm, load_critic
    from relayrl.workers import ActorWorker, CriticWorker
    from small_batch_ranks import batch

    opts = (
        "cluster=ray",
        "algo.name=ppo",
        "model.dtype=float64",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "algo.mini_batches=2",
        "algo.micro_batch_size=1",
        "optim.lr=1e-2",
        "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
        f"model.fsdp.enabled={str(fsdp).lower()}",
    )
    cfg = run_config(model_dir, tmp_path / "run", *opts)
    with ray_local():
        roles = build_ray_roles(cfg, str(model_dir), str(model_dir))
        try:
            assert roles.actor.group.size == 2
            local = ActorWorker.from_config(load_causal_lm(model_dir, torch.float64), cfg)
            local_critic = CriticWorker.from_config(load_critic(model_dir, torch.float64), cfg)
            for step, rows in enumerate((1, 3)):
                exp = batch(model_dir, rows, seed=step)
                exp.old_logprobs = roles.actor.compute_logprobs(exp)  # split by rank, gathered
                want = local.compute_logprobs(exp)
                torch.testing.assert_close(exp.old_logprobs, want, atol=TOL, rtol=0)
                stats, local_stats = roles.actor.update(exp), local.update(exp)
                assert stats["actor/loss"] == pytest.approx(local_stats["actor/loss"], abs=TOL)
                values = roles.critic.compute_values(exp)
                torch.testing.assert_close(
                    values, local_critic.compute_values(exp), atol=TOL, rtol=0
                )
                roles.critic.update(exp)
                local_critic.update(exp)
            got = roles.actor.model.state_dict()
            for n, p in local.model.state_dict().items():
                torch.testing.assert_close(got[n], p, atol=TOL, rtol=0)
            got = roles.critic.model.state_dict()
            for n, p in local_critic.model.state_dict().items():
                torch.testing.assert_close(got[n], p, atol=TOL, rtol=0)
        finally:
            roles.close()

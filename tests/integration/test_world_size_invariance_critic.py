"""World-size invariance of the critic under every loss aggregation with value clipping active,
and of a LoRA actor, with several mini-batches per step (``invariance_critic_ranks``): 2 ranks
(FSDP2, and replicated data parallel) train exactly what one process trains (float64, 3
mini-batches, 2 epochs, uneven 5 + 3 shards, micro-batches of 2; weights, LoRA adapters,
values and every update statistic within 1e-9). The quick critic cases run in the default run
(test_world_size_invariance.py); these, marked ``slow``, on their own ranks."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from invariance_critic_ranks import (
    CRITIC_CASES,
    QUICK_CRITIC,
    assert_critic_equal_one_process,
    critic_run,
    lora_run,
    rank_main,
)
from invariance_loss_ranks import assert_ranks_equal_one_process, max_diff
from relayrl.model import build_tiny_model, load_causal_lm

SLOW = tuple(c for c in CRITIC_CASES if c not in QUICK_CRITIC)
TOL = 1e-9


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("invariance_critic") / "m", hidden_size=16)


@pytest.fixture(scope="module")
def two_ranks(model) -> list[dict]:
    root = model.parent
    args = (2, str(root / "rendezvous"), str(model), str(root), (*SLOW, "lora"))
    mp.spawn(rank_main, args=args, nprocs=2, join=True)
    return [torch.load(root / f"critic_rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("case", SLOW)
def test_critic_two_ranks_equal_one_process(two_ranks, model, case, fsdp):
    one = critic_run(model, 0, 0, case, fsdp=False)
    assert all(s["critic/vf_clipfrac"] > 0 for s in one[1])  # the clip acts
    assert_critic_equal_one_process(two_ranks, one, case, fsdp)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
def test_lora_two_ranks_equal_one_process_with_mini_batches(two_ranks, model, fsdp):
    """LoRA actor, 3 mini-batches x 2 epochs (a rank's part of a mini-batch can be empty): the
    adapters, the merged weights and every statistic of one process."""
    merged, stats, adapters = lora_run(model, 0, 0, fsdp=False)
    assert all(s["actor/clipfrac"] > 0 for s in stats)  # pi_old unlike pi_theta: the clip acts
    got = [r[("lora", fsdp)] for r in two_ranks]
    assert got[0][2].keys() == adapters.keys() and any(".lora_A." in k for k in adapters)
    assert max_diff(got[0][2], adapters) < TOL
    base = load_causal_lm(model, torch.float64).state_dict()
    assert max_diff(merged, base) > 1e-4  # the adapters moved the merged weights
    ranks = [{("lora", fsdp): (g[0], g[1])} for g in got]
    assert_ranks_equal_one_process(ranks, (merged, stats), "lora", fsdp)

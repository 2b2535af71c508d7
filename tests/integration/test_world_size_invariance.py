"""World-size invariance with several mini-batches per step: the global batch is cut into
mini-batches before it is sharded to ranks, so 2 ranks (FSDP2, and replicated data
parallel) train exactly what one process trains, for every loss aggregation (float64,
3 mini-batches, 2 epochs, uneven shards, micro-batches of 2; weights within 1e-9); and, on the
same ranks, the quick cases of other policy losses and loss terms, and of the critic's
options, with their update statistics (tests/support/invariance_loss_ranks.py,
tests/support/invariance_critic_ranks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from invariance_critic_ranks import QUICK_CRITIC, assert_critic_equal_one_process, critic_run
from invariance_loss_ranks import QUICK, actor_run, assert_ranks_equal_one_process
from invariance_ranks import AGGREGATIONS, actor_weights, rank_main
from relayrl.model import build_tiny_model

TOL = 1e-9


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    model = build_tiny_model(root / "m", hidden_size=16)
    rendezvous = str(root / "rendezvous")
    mp.spawn(rank_main, args=(2, rendezvous, str(model), str(root)), nprocs=2, join=True)
    return model, torch.load(root / "invariance.pt", weights_only=False)


@pytest.fixture(scope="module")
def loss_ranks(two_ranks) -> list[dict]:
    """Every rank's results of the quick cases of ``invariance_loss_ranks`` (the same ranks)."""
    model, _ = two_ranks
    return [torch.load(model.parent / f"losses_rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def critic_ranks(two_ranks) -> list[dict]:
    """Every rank's results of the quick cases of ``invariance_critic_ranks`` (the same ranks)."""
    model, _ = two_ranks
    return [torch.load(model.parent / f"critic_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_actor_two_ranks_equal_one_process_with_mini_batches(two_ranks, agg, fsdp):
    model, got = two_ranks
    one = actor_weights(model, 0, 0, agg, fsdp=False)
    assert _max_diff(got[("actor", agg, fsdp)], one) < TOL


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("case", QUICK_CRITIC)
def test_critic_two_ranks_equal_one_process_with_mini_batches(two_ranks, critic_ranks, case, fsdp):
    """The critic with value clipping active (``critic_clipped``), and with an empty row under
    ``seq_mean_empty_rows: skip``, seq-mean-token-mean and dynamic micro-batches: weights,
    values and every update statistic (the ranks' partial vf_loss add up to one process's);
    the other aggregations in test_world_size_invariance_critic.py (slow)."""
    model, _ = two_ranks
    one = critic_run(model, 0, 0, case, fsdp=False)
    assert all(s["critic/vf_clipfrac"] > 0 for s in one[1])  # the clip acts
    assert_critic_equal_one_process(critic_ranks, one, case, fsdp)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("case", QUICK)
def test_other_losses_two_ranks_equal_one_process(two_ranks, loss_ranks, case, fsdp):
    """Other policy losses and loss terms (``invariance_loss_ranks.CASES``; the rest in
    test_world_size_invariance_losses.py, slow): weights and every update statistic."""
    model, _ = two_ranks
    assert_ranks_equal_one_process(loss_ranks, actor_run(model, 0, 0, case, False), case, fsdp)


def test_rank_parts_of_mini_batches_union_to_one_process():
    """The ranks' parts of each mini-batch (blocks of 5 + 3 + 2 rows) are exactly one
    process's mini-batch, in its order; a rank's part can be empty."""
    from relayrl.model import pack_batch
    from relayrl.workers import Experience

    rows = 10
    exp = Experience(pack_batch([[1]] * rows, [[2]] * rows, pad_id=0))
    exp.group_index = torch.arange(rows)  # each row's own id
    one = [m.group_index.tolist() for m in exp.shuffled_splits(4, torch.Generator().manual_seed(3))]
    blocks = [(0, 5), (5, 8), (8, 10)]
    parts = [
        exp.select(list(range(a, b))).shuffled_splits(
            4, torch.Generator().manual_seed(3), offset=a, total=rows
        )
        for a, b in blocks
    ]
    assert all(len(p) == len(one) for p in parts)
    empty = 0
    for i, mini in enumerate(one):
        union = [r for p in parts for r in p[i].group_index.tolist()]
        assert sorted(union) == sorted(mini)
        empty += sum(len(p[i]) == 0 for p in parts)
    assert empty > 0  # the case the ranks must still step through

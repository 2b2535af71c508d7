"""World-size invariance beyond the default loss: every registered policy loss, GRPO's KL loss
against pi_ref, the entropy bonus, rollout-correction and behaviour weights, pi_old unlike
pi_theta (the clips active), zero-advantage rows skipped per rank part and an empty row: 2
ranks (FSDP2, and replicated data parallel) train exactly what one process trains (float64,
3 mini-batches, 2 epochs, uneven 5 + 3 shards, micro-batches of 2; weights within 1e-9) and
return its update statistics (the ranks' partial losses add up to its loss)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from invariance_loss_ranks import CASES, actor_run, rank_main
from relayrl.model import build_tiny_model

TOL = 1e-9
_NOT_GLOBAL = {"actor/loss"}
"""A rank's partial loss (normalised by the global counts): the ranks' add up to the loss."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance_losses")
    model = build_tiny_model(root / "m", hidden_size=16)
    rendezvous = str(root / "rendezvous")
    mp.spawn(rank_main, args=(2, rendezvous, str(model), str(root)), nprocs=2, join=True)
    ranks = [torch.load(root / f"losses_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return model, ranks


@pytest.fixture(scope="module")
def one_process(two_ranks):
    model, _ = two_ranks
    return {case: actor_run(model, 0, 0, case, fsdp=False) for case in CASES}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _stat_diffs(ranks: list[list[dict]], one: list[dict]) -> dict[str, float]:
    """|rank statistic - one process's| per key and step (the loss: the ranks' sum)."""
    diffs = {}
    for step, want in enumerate(one):
        for r, got in enumerate(ranks):
            assert got[step].keys() == want.keys(), (r, step)
        for k, v in want.items():
            if k in _NOT_GLOBAL:
                diffs[f"{k}@{step}"] = abs(sum(got[step][k] for got in ranks) - v)
            else:
                diffs[f"{k}@{step}"] = max(abs(got[step][k] - v) for got in ranks)
    return diffs


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("case", list(CASES))
def test_actor_two_ranks_equal_one_process(two_ranks, one_process, case, fsdp):
    _, ranks = two_ranks
    weights, stats = one_process[case]
    assert _max_diff(ranks[0][(case, fsdp)][0], weights) < TOL
    diffs = _stat_diffs([r[(case, fsdp)][1] for r in ranks], stats)
    assert {k: d for k, d in diffs.items() if not d < 1e-9} == {}


def test_cases_exercise_what_they_name(one_process):
    """The batches are off-policy enough that the clips, the behaviour cap, the KL term and
    the skipped rows are all active (otherwise the invariance above proves little)."""
    s = {case: one_process[case][1][0] for case in CASES}
    assert s["ppo_dual_clip"]["actor/pg_dual_clipfrac"] > 0
    assert s["ppo_dual_clip"]["actor/clipfrac_upper"] > 0
    assert s["decoupled_ppo"]["actor/pg_capped_frac"] > 0
    assert s["decoupled_ppo_seq_clamp"]["actor/pg_capped_frac"] > 0
    assert s["gspo"]["actor/clipfrac"] > 0
    assert s["cispo"]["actor/clipfrac"] > 0
    assert s["grpo_kl_entropy"]["actor/kl"] > 0
    assert s["ppo_dual_clip"]["actor/zero_adv_skipped_frac"] > 0
    assert s["no_skip_zero_adv"]["actor/zero_adv_skipped_frac"] == 0

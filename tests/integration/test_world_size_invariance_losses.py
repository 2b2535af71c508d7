"""World-size invariance beyond the default loss: every registered policy loss, GRPO's KL loss
against pi_ref, the entropy bonus, rollout-correction and behaviour weights, pi_old unlike
pi_theta (the clips active), zero-advantage rows skipped per rank part and an empty row
(``invariance_loss_ranks.CASES``): 2 ranks (FSDP2, and replicated data parallel) train exactly
what one process trains (float64, 3 mini-batches, 2 epochs, uneven 5 + 3 shards, micro-batches
of 2; weights within 1e-9) and return its update statistics (the ranks' partial losses add up
to its loss). The ``QUICK`` cases run in the default run, on the ranks of
test_world_size_invariance.py; the others here, marked ``slow``."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from invariance_loss_ranks import CASES, QUICK, actor_run, assert_ranks_equal_one_process, rank_main
from relayrl.model import build_tiny_model

SLOW = tuple(c for c in CASES if c not in QUICK)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("invariance_losses") / "m", hidden_size=16)


@pytest.fixture(scope="module")
def two_ranks(model) -> list[dict]:
    root = model.parent
    args = (2, str(root / "rendezvous"), str(model), str(root), SLOW)
    mp.spawn(rank_main, args=args, nprocs=2, join=True)
    return [torch.load(root / f"losses_rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
@pytest.mark.parametrize("case", SLOW)
def test_actor_two_ranks_equal_one_process(two_ranks, model, case, fsdp):
    one = actor_run(model, 0, 0, case, fsdp=False)
    assert_ranks_equal_one_process(two_ranks, one, case, fsdp)


def test_cases_exercise_what_they_name(model):
    """The batches are off-policy enough that the clips, the behaviour cap, the KL term and
    the skipped rows are all active (otherwise the invariance proves little)."""
    s = {case: actor_run(model, 0, 0, case, fsdp=False)[1][0] for case in CASES}
    assert s["ppo_dual_clip"]["actor/pg_dual_clipfrac"] > 0
    assert s["ppo_dual_clip"]["actor/clipfrac_upper"] > 0
    assert s["decoupled_ppo"]["actor/pg_capped_frac"] > 0
    assert s["decoupled_ppo_seq_clamp"]["actor/pg_capped_frac"] > 0
    assert s["gspo"]["actor/clipfrac"] > 0
    assert s["cispo"]["actor/clipfrac"] > 0
    assert s["grpo_kl_entropy"]["actor/kl"] > 0
    assert s["ppo_dual_clip"]["actor/zero_adv_skipped_frac"] > 0
    assert (
        s["skip_empty_row"]["actor/zero_adv_skipped_frac"]
        > s["gspo"]["actor/zero_adv_skipped_frac"]
    )
    assert s["no_skip_zero_adv"]["actor/zero_adv_skipped_frac"] == 0
    assert s["distill_loss"]["actor/zero_adv_skipped_frac"] == 0  # the distill term trains them
    assert s["single_update_decoupled"]["actor/optimizer_steps"] == 1
    assert s["single_update_decoupled"]["actor/pg_capped_frac"] > 0

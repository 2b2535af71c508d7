"""An update's ``*_max`` statistics are maxima over the step (``ActorWorker.update``), not the
token-weighted mean of the micro-batches' maxima: they do not depend on how the rows are cut
into micro-batches, mini-batches or ranks (the 2-rank check: test_world_size_invariance)."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.model import build_tiny_model
from scale_helpers import random_experience, scale_config

DELTA = (1.0, 0.1, 0.5, 0.2, 0.9, 0.3, 0.05, 0.4)
"""log w = log pi_prox - log pi_behav of every token of row i; rows 0 and 4 have advantage 0
(``random_experience``), so they are left out of the update (``skip_zero_advantage``)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("maxstats") / "m", hidden_size=16)


@pytest.mark.parametrize("mini", [1, 2])
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_behaviour_weight_max_is_the_maximum_over_the_step(model_dir, micro, mini):
    """decoupled_ppo, w = exp(DELTA[i]) on row i's tokens, cap 5 (nothing capped): the trained
    rows are 1, 2, 3, 5, 6, 7, so behav_weight_max = exp(0.5) = 1.6487 (row 2), whatever the
    micro- and mini-batches; behav_weight_mean = sum_i n_i exp(DELTA[i]) / sum_i n_i over them
    (n_i: row i's tokens)."""
    from relayrl.workers.build import build_actor

    opts = ("model.dtype=float64", "algo.policy_loss=decoupled_ppo", f"algo.mini_batches={mini}")
    cfg = scale_config(model_dir, *opts, f"algo.micro_batch_size={micro}")
    actor = build_actor(cfg, str(model_dir))
    exp = random_experience(model_dir, rows=8, dtype=torch.float64)
    mask = exp.response_mask.to(torch.float64)
    exp.old_logprobs = actor.compute_logprobs(exp)
    delta = torch.tensor(DELTA, dtype=torch.float64)[:, None] * mask
    exp.behaviour_logprobs = exp.old_logprobs - delta
    stats = actor.update(exp)
    assert stats["actor/pg_behav_weight_max"] == pytest.approx(math.exp(0.5), abs=1e-12)
    trained = [1, 2, 3, 5, 6, 7]
    n = mask.sum(-1)
    mean = sum(float(n[i]) * math.exp(DELTA[i]) for i in trained) / float(n[trained].sum())
    assert stats["actor/pg_behav_weight_mean"] == pytest.approx(mean, abs=1e-12)


def test_reduce_sums_takes_the_maxima_as_they_are_in_one_process(tmp_path):
    """One process, and one gloo rank (a real all_gather / all_reduce): the sums summed (over
    one rank: as they are), the maxima kept."""
    import torch.distributed as dist

    from relayrl.workers.data_parallel import ReplicatedDataParallel
    from relayrl.workers.parallel import SingleProcess

    sums, maxes = {"a": 1.5, "weight:a": 3.0}, {"max:b": 2.5}
    want = {"a": 1.5, "weight:a": 3.0, "max:b": 2.5}
    assert SingleProcess().reduce_sums(sums, maxes) == want
    assert SingleProcess().reduce_sums(sums) == sums
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert ReplicatedDataParallel().reduce_sums(sums, maxes) == want
        assert ReplicatedDataParallel().reduce_sums(sums) == sums
    finally:
        dist.destroy_process_group()

"""Rank code of tests/integration/test_world_size_invariance.py (importable by spawned
children): the actor trained with several mini-batches per step, for every loss aggregation,
on FSDP2 and on replicated data-parallel ranks (world 0: one process); and the quick cases of
``invariance_loss_ranks`` (other policy losses and loss terms) and of
``invariance_critic_ranks`` (the critic)."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_ranks import shard
from helpers import join_gloo, leave_process_group
from scale_helpers import random_experience, scale_config

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum",
)
# 8 rows in 3 mini-batches (3 + 3 + 2) over 5 + 3 rows per rank: each rank's part of a
# mini-batch is uneven, and can be empty; micro-batches of 2 rows; 2 epochs, 2 steps.
MINI = ("model.dtype=float64", "algo.mini_batches=3", "algo.epochs=2")
MICRO = ("algo.micro_batch_size=2", "optim.grad_clip=0.5")


def actor_weights(model_dir: Path, rank: int, world: int, agg: str, fsdp: bool) -> dict:
    """Weights after 2 steps of this rank's shard; world 0: one process, all rows."""
    from relayrl.workers.build import build_actor

    opts = (*MINI, *MICRO, f"algo.loss_agg={agg}", *(["model.fsdp.enabled=true"] * fsdp))
    actor = build_actor(scale_config(model_dir, *opts), str(model_dir), rank, max(world, 1))
    for step in range(2):
        exp = shard(random_experience(model_dir, seed=step, dtype=torch.float64), rank, world or 1)
        exp.old_logprobs = actor.compute_logprobs(exp)
        actor.update(exp)
    return actor.state_dict()


def rank_main(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import invariance_critic_ranks as critic  # (they import MINI and MICRO)
    from invariance_loss_ranks import QUICK, run_cases

    join_gloo(rank, world, init_file)
    d = Path(model_dir)
    out: dict = {}
    for fsdp in (True, False):
        for agg in AGGREGATIONS:
            out[("actor", agg, fsdp)] = actor_weights(d, rank, world, agg, fsdp)
    if rank == 0:
        torch.save(out, Path(out_dir) / "invariance.pt")
    # the quick cases of the other losses and terms (every rank's statistics)
    torch.save(run_cases(d, rank, world, QUICK), Path(out_dir) / f"losses_rank{rank}.pt")
    quick = critic.run_cases(d, rank, world, critic.QUICK_CRITIC)
    torch.save(quick, Path(out_dir) / f"critic_rank{rank}.pt")
    leave_process_group()

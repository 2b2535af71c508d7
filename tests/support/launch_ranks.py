"""Rank code of tests/integration/test_launch_ranks.py (importable by spawned children): the
statistics one update returns on each of 2 ranks (FSDP2 and replicated data parallel; actor
and critic; float64, uneven 5 + 3 shards, 3 mini-batches, 2 epochs) and on one process."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_ranks import critic_experience, shard
from helpers import join_gloo, leave_process_group
from scale_helpers import random_experience, scale_config

OPTS = ("model.dtype=float64", "algo.mini_batches=3", "algo.epochs=2", "algo.micro_batch_size=2")


def actor_stats(model_dir: Path, rank: int, world: int, fsdp: bool) -> dict[str, float]:
    """One update's statistics on this rank's shard; world 0: one process, all rows."""
    from relayrl.workers.build import build_actor

    cfg = scale_config(model_dir, *OPTS, *(["model.fsdp.enabled=true"] * fsdp))
    actor = build_actor(cfg, str(model_dir), rank, max(world, 1))
    exp = shard(random_experience(model_dir, seed=0, dtype=torch.float64), rank, world or 1)
    exp.old_logprobs = actor.compute_logprobs(exp)
    return actor.update(exp)


def critic_stats(model_dir: Path, rank: int, world: int, fsdp: bool) -> dict[str, float]:
    from relayrl.workers.build import build_critic

    cfg = scale_config(model_dir, *OPTS, "algo.name=ppo", *(["model.fsdp.enabled=true"] * fsdp))
    critic = build_critic(cfg, str(model_dir), rank, max(world, 1))
    return critic.update(shard(critic_experience(model_dir), rank, world or 1))


def rank_main(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Every rank's statistics, gathered on rank 0 and saved as ``stats.pt``."""
    join_gloo(rank, world, init_file)
    d = Path(model_dir)
    out: dict = {}
    for fsdp in (True, False):
        for role, fn in (("actor", actor_stats), ("critic", critic_stats)):
            per_rank: list = [None] * world
            dist.all_gather_object(per_rank, fn(d, rank, world, fsdp))
            out[(role, fsdp)] = per_rank
    if rank == 0:
        torch.save(out, Path(out_dir) / "stats.pt")
    leave_process_group()


RESHARD = ("model.dtype=float64", "model.fsdp.enabled=true", "algo.micro_batch_size=2")


def _reshard_actor(model_dir: Path, rank: int, world: int):
    from relayrl.workers.build import build_actor

    return build_actor(scale_config(model_dir, *RESHARD), str(model_dir), rank, world)


def _reshard_step(actor, model_dir: Path, rank: int, world: int, seed: int) -> None:
    exp = shard(random_experience(model_dir, seed=seed, dtype=torch.float64), rank, world)
    exp.old_logprobs = actor.compute_logprobs(exp)
    actor.update(exp)


def reshard_main(
    rank: int, world: int, init_file: str, model_dir: str, ckpt: str, out: str, save: bool
) -> None:
    """An FSDP2 actor on ``world`` ranks: with ``save``, step 1, the sharded checkpoint
    ``ckpt``, then step 2; else ``ckpt`` loaded, then step 2. Rank 0 saves the full weights
    after step 2 to ``out``."""
    from relayrl.workers.fsdp import full_state_dict

    join_gloo(rank, world, init_file)
    d = Path(model_dir)
    actor = _reshard_actor(d, rank, world)
    if save:
        _reshard_step(actor, d, rank, world, seed=0)
        actor.save_sharded(ckpt)
    else:
        actor.load_sharded(ckpt)
    _reshard_step(actor, d, rank, world, seed=1)
    state = full_state_dict(actor.model, 1 << 20)
    if rank == 0:
        torch.save(state, out)
    leave_process_group()

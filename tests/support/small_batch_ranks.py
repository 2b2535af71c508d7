"""Rank code of tests/integration/test_small_batches_ranks.py (importable by spawned children):
steps whose batch has fewer sequences than ranks, or mini-batches some rank has no rows of,
on FSDP2 and replicated data-parallel ranks (world 0: one process on the whole batch).

Each rank gets its block of rows from the worker group's ``split_experience`` (a rank may get
none), computes pi_old (``compute_logprobs``) or old values (``compute_values``) on it and
takes 2 steps (float64). The results saved per case: the full weights after the steps, each
rank's logprobs / values and update statistics, and the sizes of each rank's parts of the
mini-batches (to check the case under test happened)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from helpers import join_gloo, leave_process_group
from relayrl.workers import Experience
from relayrl.workers.data_parallel import split_experience
from scale_helpers import random_experience, scale_config

# (rows of the global batch, algo.mini_batches, algo.micro_batch_size)
CASES = ((1, 1, 1), (3, 2, 2))
COMMON = ("model.dtype=float64", "algo.epochs=2", "optim.grad_clip=0.5")


def batch(model_dir: Path, rows: int, seed: int) -> Experience:
    """``rows`` random rows, every one with a nonzero advantage (so every row trains), and
    returns / old values for the critic (float64)."""
    exp = random_experience(model_dir, rows=rows, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(100 + seed)
    mask = exp.response_mask.to(torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64) + 2.0
    exp.advantages = adv.expand_as(mask) * mask
    exp.returns = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    exp.values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.1 * mask
    return exp


def my_rows(exp: Experience, rank: int, world: int) -> tuple[Experience, int]:
    """This rank's block (world 0: the whole batch) and its offset in the global batch."""
    if not world:
        return exp, 0
    blocks = split_experience(exp, world)
    return blocks[rank], sum(len(b) for b in blocks[:rank])


def part_sizes(worker: Any, mine: Experience, offset: int, total: int) -> list[int]:
    """Sizes of this rank's parts of the next draw of mini-batches (the generator untouched)."""
    g = torch.Generator()
    g.set_state(worker.generator.get_state())
    return [len(p) for p in mine.shuffled_splits(worker.algo.mini_batches, g, offset, total)]


def run_case(model_dir: Path, rank: int, world: int, fsdp: bool, case: tuple) -> dict:
    from relayrl.workers.build import build_actor, build_critic
    from relayrl.workers.fsdp import full_state_dict

    rows, mini, micro = case
    opts = (
        *COMMON,
        f"algo.mini_batches={mini}",
        f"algo.micro_batch_size={micro}",
        *(["model.fsdp.enabled=true"] * fsdp),
    )
    cfg = scale_config(model_dir, *opts)
    critic_cfg = scale_config(model_dir, *opts, "algo.name=ppo")
    n = max(world, 1)
    actor = build_actor(cfg, str(model_dir), rank, n)
    critic = build_critic(critic_cfg, str(model_dir), rank, n)
    out: dict = {"logprobs": [], "values": [], "actor_stats": [], "critic_stats": [], "parts": []}
    for step in range(2):
        mine, offset = my_rows(batch(model_dir, rows, seed=step), rank, world)
        mine.old_logprobs = actor.compute_logprobs(mine)
        out["logprobs"].append(mine.old_logprobs)
        out["parts"].append(part_sizes(actor, mine, offset, rows))
        out["actor_stats"].append(actor.update(mine))
        values = critic.compute_values(mine)
        out["values"].append(values)
        out["parts"].append(part_sizes(critic, mine, offset, rows))
        out["critic_stats"].append(critic.update(mine))
    if fsdp:
        out["actor"] = full_state_dict(actor.model, 1 << 20)
        out["critic"] = full_state_dict(critic.model, 1 << 20)
    else:
        out["actor"] = actor.model.state_dict()
        out["critic"] = critic.model.state_dict()
    return out


def rank_main(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Every case on FSDP2 and replicated ranks; rank 0 saves every rank's results
    (weights: rank 0's, the full ones) as ``small.pt``."""
    join_gloo(rank, world, init_file)
    d = Path(model_dir)
    saved: dict = {}
    for fsdp in (True, False):
        for case in CASES:
            got = run_case(d, rank, world, fsdp, case)
            per_rank: list = [None] * world
            small = {k: v for k, v in got.items() if k not in ("actor", "critic")}
            dist.all_gather_object(per_rank, small)
            saved[(fsdp, case)] = {
                "actor": got["actor"],
                "critic": got["critic"],
                "ranks": per_rank,
            }
    if rank == 0:
        torch.save(saved, Path(out_dir) / "small.pt")
    leave_process_group()

"""The rank processes of tests/integration/test_fsdp.py (importable by spawned children)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers import join_gloo, leave_process_group
from relayrl.workers import Experience
from scale_helpers import random_experience, scale_config

ACTOR = ("model.dtype=float64", "algo.epochs=2", "algo.micro_batch_size=1", "optim.grad_clip=0.5")
CRITIC = (*ACTOR, "algo.name=ppo")
BF16 = ("model.dtype=bfloat16", "algo.micro_batch_size=1", "optim.grad_clip=0.5")


def critic_experience(model_dir: Path) -> Experience:
    """Random returns and old values for the value loss (float64)."""
    exp = random_experience(model_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    mask = exp.response_mask.to(torch.float64)
    exp.returns = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    exp.values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.1 * mask
    return exp


def shard(exp: Experience, rank: int, world: int) -> Experience:
    """Contiguous uneven shards (5 + 3 rows of 8): ranks run different micro-batch counts."""
    cut = [0, 5, len(exp)] if world == 2 else [0, len(exp)]
    return exp.select(list(range(cut[rank], cut[rank + 1])))


def train_actor(
    model_dir: Path, rank: int, world: int, steps: int = 1, opts: tuple[str, ...] = ACTOR
) -> tuple[object, list]:
    """``steps`` updates of this rank's shard; world 0: a plain actor on the whole batch."""
    from relayrl.workers.build import build_actor

    cfg = scale_config(model_dir, *opts, *(["model.fsdp.enabled=true"] if world else []))
    actor = build_actor(cfg, str(model_dir), rank, max(world, 1))
    stats = []
    for step in range(steps):
        exp = shard(random_experience(model_dir, seed=step, dtype=torch.float64), rank, world or 1)
        exp.old_logprobs = actor.compute_logprobs(exp)
        stats.append({**actor.update(exp), "old_logprobs": exp.old_logprobs})
    return actor, stats


def train_critic(model_dir: Path, rank: int, world: int) -> tuple[object, dict]:
    from relayrl.workers.build import build_critic

    cfg = scale_config(model_dir, *CRITIC, *(["model.fsdp.enabled=true"] if world else []))
    critic = build_critic(cfg, str(model_dir), rank, max(world, 1))
    exp = shard(critic_experience(model_dir), rank, world or 1)
    values = critic.compute_values(exp)
    return critic, {"values": values, **critic.update(exp)}


def reference_logprobs(model_dir: Path, rank: int, world: int) -> torch.Tensor:
    """log pi_ref of this rank's shard (world 0: a plain reference on the whole batch)."""
    from relayrl.workers.build import build_reference

    cfg = scale_config(model_dir, *ACTOR, *(["model.fsdp.enabled=true"] if world else []))
    ref = build_reference(cfg, None, rank, max(world, 1))
    exp = shard(random_experience(model_dir, seed=3, dtype=torch.float64), rank, world or 1)
    return ref.compute_logprobs(exp)


def rank_main(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    """Actor and critic steps on this rank's shard; rank 0 saves the full results; then a
    sharded checkpoint after step 1, step 2 trained on, and a fresh actor resumed from it;
    then a LoRA actor data-parallel and an FSDP2 actor with CPU offload (``dp_ranks``)."""
    from dp_ranks import lora_and_offload
    from relayrl.controller.sharded_checkpoint import load_sharded, save_sharded
    from relayrl.workers.fsdp import full_state_dict, iter_full_state_buckets

    join_gloo(rank, world, init_file)
    d, out = Path(model_dir), Path(out_dir)
    actor, stats = train_actor(d, rank, world)
    weights = actor.state_dict()  # a collective: full tensors on rank 0
    critic, cstats = train_critic(d, rank, world)
    cweights = full_state_dict(critic.model, 1 << 20)
    # bucketed gather: no bucket above the bound unless one tensor alone is larger
    bound = 4096
    sizes = [
        (sum(t.numel() * t.element_size() for t in b.values()), len(b))
        for b in iter_full_state_buckets(actor.model, bound)
    ]
    _, bf16 = train_actor(d, rank, world, opts=BF16)
    ref_logprobs = reference_logprobs(d, rank, world)
    # exact resume from a sharded checkpoint
    ckpt = out / "sharded"
    save_sharded(ckpt, {"actor": actor})
    exp2 = shard(random_experience(d, seed=1, dtype=torch.float64), rank, world)
    exp2.old_logprobs = actor.compute_logprobs(exp2)
    actor.update(exp2)
    straight = actor.state_dict()
    fresh, _ = train_actor(d, rank, world, steps=0)
    load_sharded(ckpt, {"actor": fresh})
    exp2 = shard(random_experience(d, seed=1, dtype=torch.float64), rank, world)
    exp2.old_logprobs = fresh.compute_logprobs(exp2)
    fresh.update(exp2)
    resumed = fresh.state_dict()
    extra = lora_and_offload(d, rank, world)  # tests/support/dp_ranks.py: LoRA DP, cpu_offload
    if rank == 0:
        torch.save(
            {
                **extra,
                "actor": weights,
                "stats": stats,
                "bf16": bf16,
                "reference": ref_logprobs,
                "critic": cweights,
                "critic_stats": {k: v for k, v in cstats.items() if k != "values"},
                "values": cstats["values"],
                "buckets": sizes,
                "straight": straight,
                "resumed": resumed,
            },
            out / "rank0.pt",
        )
    leave_process_group()

"""Rank code of tests/integration/test_fsdp.py (run inside ``fsdp_ranks.rank_main``): a LoRA
actor on 2 data-parallel ranks, and an FSDP2 actor with ``model.fsdp.cpu_offload``."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_ranks import ACTOR, shard, train_actor
from scale_helpers import random_experience, scale_config

LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0.0")
OFFLOAD = (*ACTOR, "model.fsdp.cpu_offload=true")


def train_lora(
    model_dir: Path, rank: int, world: int, steps: int = 2, fsdp: bool = False
) -> tuple[object, list]:
    """``steps`` LoRA updates (float64) of this rank's shard; world 0: one process, all rows;
    ``fsdp``: on an FSDP2-sharded base."""
    from relayrl.workers.build import build_actor

    cfg = scale_config(model_dir, *ACTOR, *LORA, *(["model.fsdp.enabled=true"] if fsdp else []))
    torch.manual_seed(rank + 7)  # ranks draw different lora_A: rank 0's is broadcast
    actor = build_actor(cfg, str(model_dir), rank, max(world, 1))
    stats = []
    for step in range(steps):
        exp = shard(random_experience(model_dir, seed=step, dtype=torch.float64), rank, world or 1)
        exp.old_logprobs = actor.compute_logprobs(exp)
        stats.append(actor.update(exp))
    return actor, stats


def lora_and_offload(d: Path, rank: int, world: int) -> dict:
    """On an initialised group: 2 LoRA updates data-parallel, 2 FSDP2 updates with CPU offload;
    rank 0's results (the others' are {})."""
    lora, lora_stats = train_lora(d, rank, world)
    adapters = {n: p.detach().clone() for n, p in lora.model.named_parameters() if p.requires_grad}
    merged = lora.state_dict()
    fsdp_lora = lora_on_fsdp(d, rank, world)
    offload, offload_stats = train_actor(d, rank, world, steps=2, opts=OFFLOAD)
    weights = offload.state_dict()  # a collective: full tensors on rank 0
    devices = sorted({p.device.type for p in offload.model.parameters()})
    policy = offload.model._get_fsdp_state()._fsdp_param_group.offload_policy
    if rank:
        return {}
    return {
        **fsdp_lora,
        "lora_merged": merged,
        "lora_adapters": adapters,
        "lora_stats": lora_stats,
        "lora_parallelism": type(lora.parallelism).__name__,
        "lora_option": lora.lora is not None,
        "offload": weights,
        "offload_stats": [{k: v for k, v in s.items()} for s in offload_stats],
        "offload_devices": devices,
        "offload_policy": type(policy).__name__,
    }


def lora_on_fsdp(d: Path, rank: int, world: int) -> dict:
    """2 LoRA updates on an FSDP2-sharded base, then the merged weights, the peft state and
    the reference logprobs (adapters disabled) of this rank's shard; rank 0's ({} elsewhere)."""
    from relayrl.workers.build import build_reference

    actor, stats = train_lora(d, rank, world, fsdp=True)
    merged = actor.state_dict()  # collectives: full tensors on rank 0
    peft_state = actor.adapter_state()
    cfg = scale_config(d, *ACTOR, *LORA, "model.fsdp.enabled=true")
    ref = build_reference(cfg, actor, rank, world)
    exp = shard(random_experience(d, seed=3, dtype=torch.float64), rank, world)
    ref_logprobs = ref.compute_logprobs(exp)
    if rank:
        return {}
    return {
        "fsdp_lora_parallelism": type(actor.parallelism).__name__,
        "fsdp_lora_option": actor.lora is not None,
        "fsdp_lora_ref_shares": ref.adapters_off
        and ref.model is actor.model
        and ref.parallelism is actor.parallelism,
        "fsdp_lora_merged": merged,
        "fsdp_lora_peft": peft_state,
        "fsdp_lora_stats": stats,
        "fsdp_lora_reference": ref_logprobs,
    }

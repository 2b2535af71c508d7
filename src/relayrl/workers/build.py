"""Build the trainable and frozen roles of a run on their device, in their precision.

One place decides, from ``model.*``, what a role's model is: loaded in the role's parameter
dtype (fp32 master weights for a trainable role under bf16 mixed precision), on
``model.device`` (rank r -> local CUDA device r), with activation checkpointing, LoRA adapters
(``model.lora``) and FSDP2 sharding (``model.fsdp``) as configured, and wrapped in the worker
class that fits (single process, replica data parallel, FSDP2). The cluster back-ends call
these instead of ``load_causal_lm`` + ``ActorWorker.from_config``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.config import RunConfig
from relayrl.model import load_causal_lm, load_critic
from relayrl.model.device import (
    apply_precision,
    enable_gradient_checkpointing,
    precision_for,
    resolve_device,
)
from relayrl.model.lora import apply_lora, is_lora
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.data_parallel import DataParallelActorWorker, DataParallelCriticWorker
from relayrl.workers.lora import (
    AdapterDisabledReference,
    LoraActorWorker,
    LoraDataParallelActorWorker,
)


def _distributed(cfg: RunConfig, world: int) -> bool:
    """Whether the role runs over a process group (world > 1, or FSDP on any world)."""
    if cfg.model.fsdp.enabled and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "model.fsdp.enabled: no torch.distributed process group is initialised "
            "(cluster=ray builds FSDP2 roles after joining one; in your own script call "
            "torch.distributed.init_process_group on every rank before building the roles)"
        )
    return world > 1 or cfg.model.fsdp.enabled


def _load_lm(cfg: RunConfig, path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM from ``path``; a peft adapter directory (a LoRA checkpoint) loads onto the
    base model ``model.path`` with its adapters trainable."""
    if (Path(path) / "adapter_config.json").is_file():
        from peft import PeftModel

        base = load_causal_lm(cfg.model.path, dtype)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(base)
        return PeftModel.from_pretrained(base, path, is_trainable=True)
    model = load_causal_lm(path, dtype)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    return model


def build_actor(cfg: RunConfig, path: str, rank: int = 0, world: int = 1) -> ActorWorker:
    """The actor: fp32 master weights under bf16 mixed precision, LoRA / FSDP2 as configured."""
    precision = precision_for(cfg.model, trainable=True)
    model = apply_precision(
        _load_lm(cfg, path, precision.param_dtype),
        precision,
        resolve_device(cfg.model.device, rank),
    )
    if is_lora(model):
        if cfg.model.fsdp.enabled and _distributed(cfg, world):
            from relayrl.workers.fsdp_lora import FsdpLoraActorWorker

            return FsdpLoraActorWorker.from_config(model, cfg)
        if world > 1:
            return LoraDataParallelActorWorker.from_config(model, cfg)
        return LoraActorWorker.from_config(model, cfg)
    if _distributed(cfg, world):
        if cfg.model.fsdp.enabled:
            from relayrl.workers.fsdp import FsdpActorWorker

            return FsdpActorWorker.from_config(model, cfg)
        return DataParallelActorWorker.from_config(model, cfg)
    return ActorWorker.from_config(model, cfg)


def build_reference(
    cfg: RunConfig, actor: ActorWorker | None, rank: int = 0, world: int = 1
) -> ReferenceWorker:
    """The frozen reference: the actor with adapters disabled under LoRA, else ``model.path``
    in the compute dtype (bf16 weights under bf16: a frozen role needs no master copy)."""
    if actor is not None and is_lora(actor.model):
        if getattr(actor, "sharded", False):
            from relayrl.workers.fsdp_lora import FsdpAdapterDisabledReference

            return FsdpAdapterDisabledReference(actor, cfg)  # type: ignore[arg-type]
        return AdapterDisabledReference(actor, cfg)
    precision = precision_for(cfg.model, trainable=False)
    model = apply_precision(
        load_causal_lm(cfg.model.path, precision.param_dtype),
        precision,
        resolve_device(cfg.model.device, rank),
    )
    if cfg.model.fsdp.enabled and _distributed(cfg, world):
        from relayrl.workers.fsdp import FsdpReferenceWorker

        return FsdpReferenceWorker.from_config(model, cfg)
    return ReferenceWorker.from_config(model, cfg)


def build_critic(cfg: RunConfig, path: str, rank: int = 0, world: int = 1) -> CriticWorker:
    """The critic: precision, device, checkpointing and FSDP2 as the actor (no LoRA)."""
    precision = precision_for(cfg.model, trainable=True)
    model = load_critic(path, precision.param_dtype)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_precision(model, precision, resolve_device(cfg.model.device, rank))
    if _distributed(cfg, world):
        if cfg.model.fsdp.enabled:
            from relayrl.workers.fsdp import FsdpCriticWorker

            return FsdpCriticWorker.from_config(model, cfg)
        return DataParallelCriticWorker.from_config(model, cfg)
    return CriticWorker.from_config(model, cfg)


def engine_device(cfg: RunConfig, rank: int = 0) -> torch.device:
    """Where the own rollout engine of ``rank`` computes: ``model.device`` as the trainer's
    roles resolve it (rank r -> local CUDA device r). The engine follows its model there (KV
    cache, sampler, batches); the vLLM backend places itself."""
    return resolve_device(cfg.model.device, rank)


def engine_model(
    cfg: RunConfig, actor: ActorWorker, path: str, keep: bool | None = None, rank: int = 0
) -> torch.nn.Module:
    """The rollout engine's own model: the actor's weights (merged under LoRA) as a plain HF
    model in the compute dtype on ``engine_device(cfg, rank)``, frozen. Under FSDP2 every rank
    must call (the full weights are gathered bucket by bucket); ranks with ``keep`` False
    (default: all but rank 0) get the unloaded model."""
    precision = precision_for(cfg.model, trainable=False)
    device = engine_device(cfg, rank)
    if is_lora(actor.model) or cfg.model.fsdp.enabled:
        model = load_causal_lm(
            cfg.model.path if is_lora(actor.model) else path, precision.param_dtype
        )
        if cfg.model.fsdp.enabled:
            from relayrl.workers.fsdp import full_state_dict

            bucket = int(cfg.model.fsdp.sync_bucket_mb * (1 << 20))
            state = full_state_dict(actor.model, bucket, keep)
        else:
            state = actor.state_dict()
        if state:
            with torch.no_grad():
                model.load_state_dict(state)
    else:
        model = copy.deepcopy(actor.model)
    model = apply_precision(model, precision, device)
    return model.eval().requires_grad_(False)

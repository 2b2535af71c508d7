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
from torch import Tensor

from relayrl.config import RunConfig
from relayrl.model import load_causal_lm, load_critic
from relayrl.model.device import (
    apply_precision,
    enable_gradient_checkpointing,
    precision_for,
    resolve_device,
)
from relayrl.model.lora import adapters_disabled, apply_lora, is_lora, merged_state_dict
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.data_parallel import DataParallelActorWorker, DataParallelCriticWorker
from relayrl.workers.experience import Experience


def _distributed(cfg: RunConfig, world: int) -> bool:
    """Whether the role runs over a process group (world > 1, or FSDP on any world)."""
    if cfg.model.fsdp.enabled and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "model.fsdp.enabled: no torch.distributed process group is initialised "
            "(cluster=ray builds FSDP2 roles after joining one; in your own script call "
            "torch.distributed.init_process_group on every rank before building the roles)"
        )
    return world > 1 or cfg.model.fsdp.enabled


class LoraActorWorker(ActorWorker):
    """The actor of a LoRA run: adapters train; ``state_dict`` is the merged full model
    (the weights the rollout engine runs), under the base model's keys."""

    def state_dict(self) -> dict[str, Tensor]:
        return merged_state_dict(self.model)


def broadcast_trainable(model: torch.nn.Module) -> None:
    """Every trainable parameter (the LoRA adapters) set to rank 0's values: peft draws
    ``lora_A`` from each process's own RNG, so the ranks' adapters start different."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


class LoraDataParallelActorWorker(LoraActorWorker, DataParallelActorWorker):
    """A LoRA actor on one data-parallel rank: each rank holds the full frozen base and the
    adapters (replicas); only the adapters' gradients are all-reduced (SUM, over the global
    loss counts), so every rank takes the single-process step. The adapters start as rank
    0's (peft draws ``lora_A`` from each process's own RNG)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> ActorWorker:
        broadcast_trainable(model)
        return super().from_config(model, cfg)


class AdapterDisabledReference(ReferenceWorker):
    """The reference of a LoRA run: the actor's own model with its adapters disabled, so
    pi_ref is the base model without a second copy of its weights."""

    def __init__(self, actor: ActorWorker, cfg: RunConfig):
        # not ReferenceWorker.__init__: that would freeze (and eval) the actor's model
        self.model = actor.model
        self.micro_batch_size = cfg.algo.micro_batch_size
        self.micro_batch_tokens = cfg.algo.micro_batch_tokens
        self.temperature = cfg.rollout.temperature

    def compute_logprobs(self, exp: Experience) -> Tensor:
        with adapters_disabled(self.model):
            return super().compute_logprobs(exp)


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

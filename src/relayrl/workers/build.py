"""Build the trainable and frozen roles of a run on their device, in their precision.

One place decides, from ``model.*``, what a role's model is: loaded in the role's parameter
dtype (fp32 master weights for a trainable role under bf16 mixed precision), on
``model.device`` (rank r -> local CUDA device r), with activation checkpointing, LoRA adapters
(``model.lora``: a ``LoraOption`` on the actor) and FSDP2 sharding (``model.fsdp``) as
configured, held by the one worker class of its role with the ``Parallelism`` strategy that
fits (``parallelism_for``: one process, replicated data parallel, FSDP2). The cluster
back-ends call these instead of ``load_causal_lm`` + ``ActorWorker.from_config``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from relayrl.config import FsdpConfig, ModelConfig, RunConfig
from relayrl.model import load_causal_lm, load_critic
from relayrl.model.device import (
    apply_precision,
    enable_gradient_checkpointing,
    precision_for,
    resolve_device,
)
from relayrl.model.lora import is_lora
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.data_parallel import ReplicatedDataParallel
from relayrl.workers.lora import LoraOption, is_adapter_dir
from relayrl.workers.parallel import Parallelism, SingleProcess


def parallelism_for(fsdp: FsdpConfig, world: int) -> Parallelism:
    """A role's strategy (a new one per role: an FSDP2 one holds its model's padder):
    ``Fsdp2Sharded`` with ``model.fsdp.enabled`` (on any world; a process group must be
    initialised), ``ReplicatedDataParallel`` on a world over 1, else ``SingleProcess``."""
    if fsdp.enabled:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "model.fsdp.enabled: no torch.distributed process group is initialised "
                "(cluster=ray builds FSDP2 roles after joining one; in your own script call "
                "torch.distributed.init_process_group on every rank before building the roles)"
            )
        from relayrl.workers.fsdp import Fsdp2Sharded

        return Fsdp2Sharded(fsdp)
    return ReplicatedDataParallel() if world > 1 else SingleProcess()


def _load_lm(
    model_cfg: ModelConfig, path: str, dtype: torch.dtype
) -> tuple[torch.nn.Module, LoraOption | None]:
    """A causal LM from ``path`` and its LoRA option: a peft adapter directory (a LoRA
    checkpoint) loads onto the base model ``model.path`` with its adapters trainable;
    ``model.lora`` wraps fresh adapters."""
    adapter_dir = path if is_adapter_dir(path) else None
    model = load_causal_lm(model_cfg.path if adapter_dir else path, dtype)
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if adapter_dir is None and model_cfg.lora is None:
        return model, None
    lora = LoraOption(model_cfg.lora)
    return lora.wrap(model, adapter_dir), lora


def build_actor(cfg: RunConfig, path: str, rank: int = 0, world: int = 1) -> ActorWorker:
    """The actor: fp32 master weights under bf16 mixed precision, LoRA / FSDP2 as configured."""
    precision = precision_for(cfg.model, trainable=True)
    model, lora = _load_lm(cfg.model, path, precision.param_dtype)
    model = apply_precision(model, precision, resolve_device(cfg.model.device, rank))
    parallelism = parallelism_for(cfg.model.fsdp, world)
    if lora is not None:
        lora.prepare(model, parallelism)  # the ranks start from rank 0's adapters
    model = parallelism.wrap(model, precision)
    return ActorWorker.from_config(model, cfg, parallelism, lora)


def build_reference(
    cfg: RunConfig, actor: ActorWorker | None, rank: int = 0, world: int = 1
) -> ReferenceWorker:
    """The frozen reference: the actor with adapters disabled under LoRA, else ``model.path``
    in the compute dtype (bf16 weights under bf16: a frozen role needs no master copy)."""
    if actor is not None and actor.lora is not None:
        return ReferenceWorker.adapters_disabled_of(actor)
    precision = precision_for(cfg.model, trainable=False)
    model = apply_precision(
        load_causal_lm(cfg.model.path, precision.param_dtype),
        precision,
        resolve_device(cfg.model.device, rank),
    )
    parallelism = parallelism_for(cfg.model.fsdp, world)
    return ReferenceWorker.from_config(parallelism.wrap(model, precision), cfg, parallelism)


def build_critic(cfg: RunConfig, path: str, rank: int = 0, world: int = 1) -> CriticWorker:
    """The critic: precision, device, checkpointing and FSDP2 as the actor (no LoRA)."""
    precision = precision_for(cfg.model, trainable=True)
    model = load_critic(path, precision.param_dtype)
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = apply_precision(model, precision, resolve_device(cfg.model.device, rank))
    parallelism = parallelism_for(cfg.model.fsdp, world)
    return CriticWorker.from_config(parallelism.wrap(model, precision), cfg, parallelism)


def engine_device(model_cfg: ModelConfig, rank: int = 0) -> torch.device:
    """Where the own rollout engine of ``rank`` computes: ``model.device`` as the trainer's
    roles resolve it (rank r -> local CUDA device r). The engine follows its model there (KV
    cache, sampler, batches); the vLLM backend places itself."""
    return resolve_device(model_cfg.device, rank)


def engine_model(
    model_cfg: ModelConfig, actor: ActorWorker, path: str, keep: bool | None = None, rank: int = 0
) -> torch.nn.Module:
    """The rollout engine's own model: the actor's weights (merged under LoRA) as a plain HF
    model in the compute dtype on ``engine_device(model_cfg, rank)``, frozen. Under FSDP2 every rank
    must call (the full weights are gathered bucket by bucket); ranks with ``keep`` False
    (default: all but rank 0) get the unloaded model."""
    precision = precision_for(model_cfg, trainable=False)
    device = engine_device(model_cfg, rank)
    model: torch.nn.Module
    if is_lora(actor.model) or model_cfg.fsdp.enabled:
        model = load_causal_lm(
            model_cfg.path if is_lora(actor.model) else path, precision.param_dtype
        )
        state = actor.parallelism.full_state_dict(actor.model, merged=True, keep=keep)
        if state:
            with torch.no_grad():
                model.load_state_dict(state)
    else:
        model = copy.deepcopy(actor.model)
    model = apply_precision(model, precision, device)
    return model.eval().requires_grad_(False)

"""The ``local`` cluster: every role in this process, on the CPU (or one local device).

The own rollout engine runs on ``model.device`` too (``engine_device``: rank 0's device): in
this process under ``schedule: sync``, in its own process otherwise, with the weights shared
on that device (CUDA IPC on a GPU, shared memory on the CPU).

``model.fsdp.enabled`` runs the FSDP2 workers over a process group of this process alone
(world 1, started here and left by ``roles.close()``): nothing is sharded, but the FSDP2 code
path runs (CPU offload of parameters and optimizer state, the sharded checkpoint). Sharding
over several ranks needs ``cluster: ray`` (one process per rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.config import RunConfig
from relayrl.model import load_tokenizer, set_threads
from relayrl.model.lora import is_lora
from relayrl.reward import build_reward_service
from relayrl.reward.service.rm_scorer import build_reward_fn, reward_model_scorers
from relayrl.rollout import RolloutBackend, RolloutEngine
from relayrl.workers import RewardWorker, Roles
from relayrl.workers.build import (
    build_actor,
    build_critic,
    build_reference,
    engine_device,
    engine_model,
)


def build_local_roles(cfg: RunConfig, actor_path: str, critic_path: str | None) -> Roles:
    """Load the actor (and its rollout copy), reference and critic into this process.

    The reference is always the initial model (``model.path``), also when resuming.
    """
    set_threads(cfg.threads, reserved=0 if cfg.schedule == "sync" else cfg.rollout.threads)
    if cfg.weight_sync.transport != "object_store":
        raise ValueError(
            f"weight_sync.transport={cfg.weight_sync.transport} needs cluster=ray (the local "
            "cluster moves weights in-process or through shared memory)"
        )
    leave = _single_rank_group(cfg) if cfg.model.fsdp.enabled else None
    tokenizer = load_tokenizer(cfg.model.path)
    actor = build_actor(cfg, actor_path)  # device, precision, checkpointing, LoRA: model.*
    rollout: RolloutBackend  # RolloutEngine | VllmEngine | VllmServerEngine | EngineProcess
    if cfg.schedule == "sync" and cfg.rollout.backend == "vllm":  # this process or a server
        from relayrl.rollout.vllm_select import make_vllm_engine, use_server

        lora = is_lora(actor.model)
        device = str(engine_device(cfg.model))
        # a server on the trainer's GPU gets the weights device to device (CUDA IPC)
        ipc = device != "cpu" and use_server(cfg.rollout.vllm_process, device)
        ipc = ipc and not lora and not cfg.model.fsdp.enabled
        rollout = make_vllm_engine(
            cfg.model.path if lora else actor_path,
            process=cfg.rollout.vllm_process,
            device=device,
            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
            weight_transfer="ipc" if ipc else None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            max_model_len=cfg.rollout.max_model_len,
            interrupt_mode=cfg.rollout.vllm_interrupt,
            kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
            dtype=cfg.model.dtype,
            seed=cfg.seed,  # in process, vLLM re-seeds the global RNGs with it at start-up
            weight_sync_timeout_s=cfg.weight_sync.timeout_s,
            state_dict=actor.state_dict() if lora else None,  # LoRA: merged weights
        )
        if ipc:  # pragma: no cover - needs CUDA (not run here)
            from relayrl.rollout.vllm_gpu_sync import attach

            attach(rollout, actor.model, "ipc", cfg.weight_sync.timeout_s)
    elif cfg.schedule == "sync":
        rollout = RolloutEngine(
            engine_model(cfg.model, actor, actor_path),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            max_model_len=cfg.rollout.max_model_len,
            cuda_graphs=cfg.rollout.cuda_graphs,
        )
    else:  # overlap / async: the engine in its own process, weights through shared memory
        spec = EngineSpec(
            model_path=cfg.model.path if is_lora(actor.model) else actor_path,
            dtype=cfg.model.dtype,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            threads=cfg.rollout.threads,
            version=0,
            urgent_steps=cfg.async_.urgent_steps,
            max_model_len=cfg.rollout.max_model_len,
            backend=cfg.rollout.backend,
            vllm_interrupt=cfg.rollout.vllm_interrupt,
            vllm_kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
            vllm_process=cfg.rollout.vllm_process,
            vllm_gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
            device=str(engine_device(cfg.model)),
            cuda_graphs=cfg.rollout.cuda_graphs,
            weight_sync_timeout_s=cfg.weight_sync.timeout_s,
        )
        rollout = EngineProcess(spec, actor.state_dict(), sync_timeout_s=cfg.weight_sync.timeout_s)
    reference = None
    if cfg.algo.kl_coef > 0 or cfg.algo.name == "ppo":
        reference = build_reference(cfg, actor)  # LoRA: the actor with adapters disabled
    critic = None
    if cfg.algo.name == "ppo":
        critic = build_critic(cfg, critic_path or cfg.model.path)
    rm = reward_model_scorers(cfg.reward)  # the reward model (reward.model_path), if any
    reward = RewardWorker(
        build_reward_fn(cfg.reward, rm),  # rule fn and/or RM
        tokenizer,
        service=build_reward_service(cfg.reward, tokenizer, model_scorers=rm),  # if asked for
        normalize=cfg.reward.service.normalize,
        domain_key=cfg.reward.service.domain_key,
        timeout_s=cfg.reward.fn_timeout_s,
    )
    if cfg.model.fsdp.enabled:  # the controller exports HF models: gathered copies
        actor = ShardedLocalRole(actor, lambda: _actor_shadow(cfg, actor_path))  # type: ignore[assignment]
        if critic is not None:
            path = critic_path or cfg.model.path
            critic = ShardedLocalRole(critic, lambda: _critic_shadow(cfg, path))  # type: ignore[assignment]
    return Roles(actor, rollout, reward, tokenizer, reference, critic, on_close=leave)


class ShardedLocalRole:
    """An FSDP2 role of this process as the controller sees it (as ``RemoteRole`` on Ray):
    every attribute is the worker's, except ``model``, a plain HF copy refreshed from the
    gathered full weights on each access (the checkpoint's export; a LoRA actor: the peft
    model with its adapters)."""

    def __init__(self, worker: Any, load_shadow: Callable[[], Any]):
        self._worker = worker
        self._load_shadow = load_shadow
        self._shadow: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    @property
    def model(self) -> Any:
        import torch

        from relayrl.workers.fsdp import full_state_dict

        if self._shadow is None:
            self._shadow = self._load_shadow()
        state = full_state_dict(self._worker.model, 256 << 20, keep=True, merged=False)
        with torch.no_grad():
            self._shadow.load_state_dict(state)
        return self._shadow


def _actor_shadow(cfg: RunConfig, actor_path: str) -> Any:
    from relayrl.model import load_causal_lm
    from relayrl.model.device import precision_for
    from relayrl.model.lora import apply_lora

    dtype = precision_for(cfg.model, trainable=True).param_dtype
    if cfg.model.lora is None:
        return load_causal_lm(actor_path, dtype)
    return apply_lora(load_causal_lm(cfg.model.path, dtype), cfg.model.lora)


def _critic_shadow(cfg: RunConfig, path: str) -> Any:
    from relayrl.model import load_critic
    from relayrl.model.device import precision_for

    return load_critic(path, precision_for(cfg.model, trainable=True).param_dtype)


def _single_rank_group(cfg: RunConfig) -> Callable[[], None] | None:
    """Start a process group of this process alone for FSDP2 (gloo; on CUDA also NCCL for
    the CUDA tensors); returns how to leave it (None: one was already running)."""
    import torch
    import torch.distributed as dist

    from relayrl.model.device import resolve_device

    if dist.is_initialized():
        return None
    device = resolve_device(cfg.model.device, 0)
    backend = "gloo"
    if device.type == "cuda":  # pragma: no cover - no GPU here
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.destroy_process_group

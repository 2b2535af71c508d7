"""The ``local`` cluster: every role in this process, on the CPU (or one local device)."""

from __future__ import annotations

from typing import Any

from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.config import RunConfig
from relayrl.model import load_tokenizer, set_threads
from relayrl.model.lora import is_lora
from relayrl.reward import build_reward_service
from relayrl.reward.rm_scorer import build_reward_fn, reward_model_scorers
from relayrl.rollout import RolloutEngine
from relayrl.workers import RewardWorker, Roles
from relayrl.workers.build import build_actor, build_critic, build_reference, engine_model


def build_local_roles(cfg: RunConfig, actor_path: str, critic_path: str | None) -> Roles:
    """Load the actor (and its rollout copy), reference and critic into this process.

    The reference is always the initial model (``model.path``), also when resuming.
    """
    set_threads(cfg.threads, reserved=0 if cfg.schedule == "sync" else cfg.rollout.threads)
    tokenizer = load_tokenizer(cfg.model.path)
    actor = build_actor(cfg, actor_path)  # device, precision, checkpointing, LoRA: model.*
    rollout: Any  # RolloutEngine | VllmEngine | EngineProcess: the rollout interface
    if cfg.schedule == "sync" and cfg.rollout.backend == "vllm":  # in this process
        from relayrl.rollout.vllm_backend import VllmEngine

        lora = is_lora(actor.model)
        rollout = VllmEngine(
            cfg.model.path if lora else actor_path,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            interrupt_mode=cfg.rollout.vllm_interrupt,
            kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
            dtype=cfg.model.dtype,
            seed=cfg.seed,  # vLLM re-seeds this process's global RNGs with it at start-up
            state_dict=actor.state_dict() if lora else None,  # LoRA: merged weights
        )
    elif cfg.schedule == "sync":
        rollout = RolloutEngine(
            engine_model(cfg, actor, actor_path),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_slots=cfg.rollout.max_slots,
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
            backend=cfg.rollout.backend,
            vllm_interrupt=cfg.rollout.vllm_interrupt,
            vllm_kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
        )
        rollout = EngineProcess(spec, actor.state_dict())
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
    )
    return Roles(actor, rollout, reward, tokenizer, reference, critic)

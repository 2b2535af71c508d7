"""Which vLLM engine a run gets (``rollout.backend: vllm``): in this process
(:class:`~relayrl.rollout.vllm_backend.VllmEngine`) or a server process on vLLM's RL API
(:class:`~relayrl.rollout.vllm_server.VllmServerEngine`), from ``rollout.vllm_process``:
``auto`` = a server on a GPU (NCCL / CUDA IPC need sender and receiver in different
processes, and a trainer on the GPU must leave vLLM room: ``gpu_memory_utilization``), in
process on the CPU; ``server`` / ``in_process`` force one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.model.known_models import resolve_model_path
from relayrl.rollout.backend import SteppingEngine


def use_server(process: str, device: str) -> bool:
    """Whether ``rollout.vllm_process`` asks for a server process on ``device``."""
    if process == "auto":
        return device.startswith("cuda")
    return process == "server"


def make_vllm_engine(
    model_path: str | Path,
    *,
    process: str = "auto",
    device: str | torch.device = "cpu",
    gpu_memory_utilization: float | None = None,
    weight_transfer: str | None = None,
    interrupt_mode: str = "reprefill",
    state_dict: Mapping[str, Tensor] | None = None,
    weight_sync_timeout_s: float = 600.0,
    **common: Any,
) -> SteppingEngine:
    """The vLLM engine for ``process`` on ``device``; ``common``: the arguments both engines
    take (``eos_token_id``, ``pad_token_id``, ``max_slots``, ``max_model_len``, ``version``,
    ``seed``, ``kv_cache_gib``, ``dtype``); ``weight_transfer`` (a GPU server): vLLM's transfer
    engine to start (``ipc`` / ``nccl``), driven by ``vllm_gpu_sync.attach``;
    ``weight_sync_timeout_s`` (a server): the bound on each request of a weight update.
    ``model_path`` may be a known model's short name (``smollm2``: its fetched directory)."""
    model_path = resolve_model_path(model_path)  # vLLM and AutoConfig read a directory
    device = str(device)
    if use_server(process, device):
        from relayrl.rollout.vllm_server import VllmServerEngine

        if interrupt_mode != "reprefill":
            raise ValueError(
                "rollout.vllm_interrupt=keep_kv needs rollout.vllm_process=in_process (the "
                "server process re-prefills)"
            )
        return VllmServerEngine(
            model_path,
            device="cpu" if device == "cpu" else device,
            gpu_memory_utilization=gpu_memory_utilization,
            weight_transfer=weight_transfer,
            state_dict=state_dict,
            weight_sync_timeout_s=weight_sync_timeout_s,
            **common,
        )
    from relayrl.rollout.vllm_backend import VllmEngine

    return VllmEngine(
        model_path,
        interrupt_mode=interrupt_mode,  # type: ignore[arg-type]
        state_dict=state_dict,
        **common,
    )


def engine_from_spec(spec: Any, state_dict: Mapping[str, Tensor]) -> SteppingEngine:
    """The engine of an engine worker's ``EngineSpec`` (:mod:`relayrl.cluster.engine_process`):
    in process (``VllmEngine.from_spec``) or a server process, from ``spec.vllm_process``; the
    initial weights come from the worker's shared-memory ``state_dict``."""
    return make_vllm_engine(
        spec.model_path,
        process=spec.vllm_process,
        device=str(spec.device),
        gpu_memory_utilization=spec.vllm_gpu_memory_utilization,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
        max_slots=spec.max_slots,
        max_model_len=spec.max_model_len,
        version=spec.version,
        interrupt_mode=spec.vllm_interrupt,
        kv_cache_gib=spec.vllm_kv_cache_gib,
        dtype=spec.dtype,
        state_dict=state_dict,
        urgent_steps=spec.urgent_steps,
        weight_sync_timeout_s=spec.weight_sync_timeout_s,
    )

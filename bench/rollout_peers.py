"""The peer runners of ``bench/rollout.py`` (see its docstring): ``transformers`` ``generate``
on static batches, vLLM through :class:`relayrl.rollout.vllm_backend.VllmEngine`, and
``transformers``' continuous batching manager; and the weight-update latency of an engine.

Every rate is useful tokens per second (the tokens each request asked for), timed with
``clock`` (``bench/rollout.py`` passes ``time.process_time`` under ``--clock cpu``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from relayrl.rollout import GenerationRequest, SamplingParams

PAD, EOS = 0, 2


@torch.no_grad()
def run_static(
    model, prompts, targets, slots: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """HF generate on static batches; returns (useful tokens/s, fraction of decoded rows useful)."""
    useful = decoded = 0
    t0 = clock()
    for b in range(0, len(prompts), slots):
        ps, ts = prompts[b : b + slots], targets[b : b + slots]
        width = max(map(len, ps))
        ids = torch.full((len(ps), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(ps):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        n = max(ts)
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=EOS,
            pad_token_id=PAD,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
        )
        assert out.shape[1] == width + n
        useful += sum(ts)
        decoded += n * len(ps)
    dt = clock() - t0
    return useful / dt, useful / decoded


def update_latency(update, state: dict, start_version: int, n: int = 5) -> float:
    """Median seconds of ``n`` in-memory weight updates (nothing in flight)."""
    times = []
    for k in range(n):
        t0 = time.perf_counter()
        update(state, start_version + 1 + k)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def run_vllm(
    path: Path,
    model,
    prompts,
    targets,
    slots: int,
    max_len: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The vLLM row: useful tokens/s on the same requests and its weight-update latency."""
    try:
        from relayrl.rollout.vllm_backend import VllmEngine, vllm_available
    except ImportError as e:
        return {"vllm": f"skipped: {e}"}
    if not vllm_available():
        return {"vllm": "skipped: import vllm failed (make vllm-venv)"}
    try:
        engine = VllmEngine(
            path, eos_token_id=EOS, pad_token_id=PAD, max_slots=slots, max_model_len=max_len
        )
    except NotImplementedError as e:
        return {"vllm": f"skipped: {e}"}
    try:
        for i, p in enumerate(prompts[:8]):  # warm-up outside the timing
            engine.submit(GenerationRequest(p, SamplingParams(max_tokens=4, seed=i)))
        engine.drain()
        t0 = clock()
        for i, (p, t) in enumerate(zip(prompts, targets, strict=True)):
            params = SamplingParams(max_tokens=t, ignore_eos=True, seed=i)
            engine.submit(GenerationRequest(p, params))
        got = sum(len(s.response_ids) for s in engine.drain())
        dt = clock() - t0
        assert got == sum(targets), (got, sum(targets))
        st = engine.stats()
        state = model.state_dict()
        latency = update_latency(
            lambda sd, v: engine.update_weights(sd, v, interrupt=True), state, engine.version
        )
    finally:
        engine.close()
    return {
        "vllm_tok_s": got / dt,
        "vllm_slot_utilisation": st["mean_slot_utilisation"],
        "vllm_weight_update_s": latency,
    }


def run_hf_cb(
    model, prompts, targets, slots: int, clock: Callable[[], float] = time.perf_counter
) -> float | str:
    """transformers' continuous batching manager with per-request max_new_tokens."""
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        gc = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(targets),
            eos_token_id=None,
            pad_token_id=PAD,
        )
        # Size its paged cache like the engine's (otherwise it sizes it from free RAM).
        pages = -(-(max(map(len, prompts)) + max(targets)) // 256)
        cbc = ContinuousBatchingConfig(
            max_requests_per_batch=slots, page_size=256, num_blocks=slots * pages + 8
        )
        with model.continuous_batching_context_manager(
            generation_config=gc, continuous_batching_config=cbc, block=True, timeout=5
        ) as manager:
            t0 = clock()
            ids = [
                manager.add_request(p, max_new_tokens=t)
                for p, t in zip(prompts, targets, strict=True)
            ]
            done: dict[str, int] = {}
            while len(done) < len(ids):
                r = manager.get_result(timeout=5)
                if r is None:
                    if not manager.is_running():
                        return "error: manager stopped"
                    continue
                if r.is_finished():
                    done[r.request_id] = len(r.generated_tokens)
            dt = clock() - t0
        return sum(done.values()) / dt
    except Exception as e:  # the peer is optional: report why it did not run
        return f"error: {type(e).__name__}: {e}"[:200]

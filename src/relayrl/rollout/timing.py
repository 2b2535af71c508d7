"""Profile the generation engine itself: the planner's time model as relayrl's engine runs.

:func:`relayrl.plan.profiling.profile` times bare Hugging Face forwards. The engine does more
per step (slot bookkeeping, the KV cache's slots, sampling with per-token logprobs, one
forward per prefill), and for a small model that is most of a step
(docs/measurements.md), and an episode that comes back from its environment pays a whole
prefill forward for its ~50 tokens. :func:`engine_profile` keeps ``profile``'s training
figures and replaces its generation ones with the engine's, measured with ``threads`` torch threads:

* ``decode_step_s[b]``: median seconds of an engine step with ``b`` running sequences of
  ``context`` cached tokens and nothing admitted (one token each);
* ``decode_s_per_ctx_token``: ``(t(2 context) - t(context)) / (b_max * context)`` as in
  ``profile``;
* prefill: medians of steps that admit ``n`` new prompts of ``L`` tokens into an empty engine
  (prefill + the first token), at ``(1, prefill_short)`` and ``(prefill_batch, prefill_len)``;
  the straight line through the two, ``t = prefill_overhead_s + tokens /
  prefill_tokens_per_s``, gives both figures (overhead clamped at >= 0).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from relayrl.plan.profiling import profile
from relayrl.plan.timemodel import MeasuredProfile
from relayrl.rollout.engine import RolloutEngine
from relayrl.rollout.types import GenerationRequest, SamplingParams

__all__ = ["engine_profile", "engine_timings"]


def engine_timings(
    engine: RolloutEngine,
    vocab: int,
    batches: tuple[int, ...] = (1, 4, 16, 64),
    context: int = 64,
    decode_steps: int = 8,
    prefill_short: int = 16,
    prefill_batch: int = 4,
    prefill_len: int = 64,
    repeats: int = 5,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, object]:
    """The engine's decode and prefill figures (module docstring) on an idle ``engine``,
    each step timed with ``clock`` (seconds; a test passes a clock of its own)."""
    if max(batches) > engine.max_slots:
        raise ValueError(f"batch {max(batches)} exceeds the engine's {engine.max_slots} slots")
    if prefill_batch * prefill_len <= prefill_short:
        raise ValueError("prefill_batch * prefill_len must exceed prefill_short")
    gen = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen, device="cpu").tolist()

    def submit(b: int, length: int, max_tokens: int) -> None:
        for _ in range(b):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0)
            engine.submit(GenerationRequest(prompt(length), params))

    def decode(b: int, ctx: int) -> float:
        submit(b, ctx, decode_steps + 2)
        engine.step()  # the prefill
        times = []
        for _ in range(decode_steps):
            t0 = clock()
            engine.step()
            times.append(clock() - t0)
        engine.drain()
        return statistics.median(times)

    def prefill(b: int, length: int) -> float:
        times = []
        for _ in range(repeats):
            submit(b, length, 1)
            t0 = clock()
            engine.step()
            times.append(clock() - t0)
            engine.drain()
        return statistics.median(times)

    decode(max(batches), context)  # warm-up
    step_s = {int(b): decode(int(b), context) for b in sorted(set(batches))}
    bmax = max(step_s)
    t2 = decode(bmax, 2 * context)
    prefill(1, prefill_short)  # warm-up
    small, big = prefill(1, prefill_short), prefill(prefill_batch, prefill_len)
    n_small, n_big = prefill_short, prefill_batch * prefill_len
    slope = max((big - small) / (n_big - n_small), 1e-12)  # seconds per prompt token
    return {
        "decode_step_s": step_s,
        "decode_s_per_ctx_token": max(0.0, (t2 - step_s[bmax]) / (bmax * context)),
        "prefill_tokens_per_s": 1.0 / slope,
        "prefill_overhead_s": max(0.0, small - n_small * slope),
        "prefill_s": {f"1x{n_small}": small, f"{prefill_batch}x{prefill_len}": big},
    }


def engine_profile(
    model_dir: str | Path,
    threads: int = 1,
    batches: tuple[int, ...] = (1, 4, 16, 64),
    context: int = 64,
    seed: int = 0,
) -> MeasuredProfile:
    """``profile(model_dir)`` (training) with the engine's generation figures, both at
    ``threads`` torch threads (see module)."""
    from relayrl.model import load_causal_lm, load_tokenizer

    base = profile(model_dir, batches=batches, context=context, threads=threads, seed=seed)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tok = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir).eval().requires_grad_(False)
        engine = RolloutEngine(
            model,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_slots=max(batches),
        )
        with torch.inference_mode():
            m = engine_timings(engine, int(model.config.vocab_size), batches, context, seed=seed)
    finally:
        torch.set_num_threads(old)
    return replace(
        base,
        decode_step_s=m["decode_step_s"],  # type: ignore[arg-type]
        decode_s_per_ctx_token=float(m["decode_s_per_ctx_token"]),  # type: ignore[arg-type]
        prefill_tokens_per_s=float(m["prefill_tokens_per_s"]),  # type: ignore[arg-type]
        prefill_overhead_s=float(m["prefill_overhead_s"]),  # type: ignore[arg-type]
        extra={**base.extra, "source": "engine", "engine_prefill_s": m["prefill_s"]},
    )

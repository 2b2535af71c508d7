"""Measure a model's speeds on this machine: the input of :class:`ProfiledTimeModel`.

``profile(model_dir)`` loads a local Hugging Face causal LM (offline) and times, with the
given number of torch threads:

* decode steps with a KV cache at several batch sizes ``b`` (``context`` cached tokens per
  sequence), seconds per step - the median of ``decode_steps`` steps;
* the same at twice the context for the largest batch, giving the extra seconds per step per
  cached token ``(t(2c) - t(c)) / (b * c)``;
* prefill: forward tokens/s on ``prefill_batch x prefill_len`` prompts (no gradient);
* training: forward + backward + AdamW step tokens/s on ``train_batch x train_len``
  (the weights are a throw-away copy; nothing is saved);
* optionally all of it again at other thread counts (``also_threads``), since CPU speed-ups
  are far from linear in threads.

A small model profiles in a few seconds; the default sizes keep it short.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from pathlib import Path
from typing import Any

from relayrl.plan.timemodel import THREAD_MEASUREMENTS, MeasuredProfile

__all__ = ["profile"]


def profile(
    model_dir: str | Path,
    batches: tuple[int, ...] = (1, 4, 16, 64, 256),
    context: int = 64,
    decode_steps: int = 8,
    prefill_batch: int = 4,
    prefill_len: int = 128,
    train_batch: int = 4,
    train_len: int = 128,
    train_iters: int = 2,
    threads: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    also_threads: tuple[int, ...] = (),
) -> MeasuredProfile:
    """Time decode steps, prefill and training of the model in ``model_dir`` (see module doc);
    ``also_threads``: measure again at these thread counts (``MeasuredProfile.at_threads``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    p = Path(model_dir)
    if not (p / "config.json").is_file():
        raise ValueError(f"not a Hugging Face model directory (no config.json): {p}")
    if not batches or min(batches) < 1 or context < 1 or decode_steps < 1:
        raise ValueError("batches, context and decode_steps must be >= 1")
    if min(also_threads, default=1) < 1:
        raise ValueError(f"thread counts must be >= 1, got {also_threads}")
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if dt is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dt, local_files_only=True)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(seed)

    def ids(b: int, n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (b, n), generator=gen)

    # transformers renamed ``past_key_values`` to ``cache``; accept either.
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"

    def cache_of(out: object) -> object:
        c = getattr(out, "past_key_values", None)
        return c if c is not None else getattr(out, "cache", None)

    @torch.no_grad()
    def decode_time(b: int, ctx: int) -> float:
        out = model(ids(b, ctx), use_cache=True)
        past = cache_of(out)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(decode_steps + 1):
            t0 = time.perf_counter()
            out = model(nxt, use_cache=True, **{cache_arg: past})
            times.append(time.perf_counter() - t0)
            past = cache_of(out)
            nxt = out.logits[:, -1:].argmax(-1)
        return statistics.median(times[1:])

    def measure(n_threads: int) -> dict[str, Any]:
        """Every timing on ``n_threads`` torch threads (keys of ``THREAD_MEASUREMENTS``)."""
        old_threads = torch.get_num_threads()
        torch.set_num_threads(n_threads)
        try:
            model.eval()
            step_s = {int(b): decode_time(int(b), context) for b in sorted(set(batches))}
            bmax = max(step_s)
            t2 = decode_time(bmax, 2 * context)
            with torch.no_grad():
                x = ids(prefill_batch, prefill_len)
                model(x)
                t0 = time.perf_counter()
                model(x)
                prefill_tps = prefill_batch * prefill_len / (time.perf_counter() - t0)
            model.train()  # the weights are a throw-away copy
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            x = ids(train_batch, train_len)
            times = []
            for _ in range(train_iters + 1):
                t0 = time.perf_counter()
                model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
        finally:
            torch.set_num_threads(old_threads)
        return {
            "decode_step_s": step_s,
            "decode_s_per_ctx_token": max(0.0, (t2 - step_s[bmax]) / (bmax * context)),
            "prefill_tokens_per_s": prefill_tps,
            "train_tokens_per_s": train_batch * train_len / statistics.median(times[1:]),
            "t2": t2,
        }

    n_threads = threads or torch.get_num_threads()
    base = measure(n_threads)
    others = {t: measure(t) for t in sorted(set(also_threads) - {n_threads})}
    return MeasuredProfile(
        model=str(p),
        params=float(sum(t.numel() for t in model.parameters())),
        device="cpu",
        threads=n_threads,
        dtype=dtype,
        decode_context=context,
        weight_bytes=float(sum(t.numel() * t.element_size() for t in model.parameters())),
        extra={"decode_step_s_at_2x_context": base["t2"], "torch": torch.__version__},
        at_threads={t: {k: m[k] for k in THREAD_MEASUREMENTS} for t, m in others.items()},
        **{k: base[k] for k in THREAD_MEASUREMENTS},
    )

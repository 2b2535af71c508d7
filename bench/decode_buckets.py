"""Decode step cost with and without length-bucketed decode attention, same engine state.

Continuous batching under a heavy tail: a few long stragglers decode next to many fresh short
answers. Without buckets every decode row reads (and attends over) as many KV columns as the
longest live sequence; with them each length class reads its own. Builds a tiny Llama (no
weights to download), fills the engine with ``long`` sequences of ``L`` tokens, admits
``short`` fresh requests, then times decode steps with ``bucket_overhead = 0`` (off, the
baseline) and the default, on one thread. Prints one JSON line with ms per step and the ratio.

    .venv/bin/python bench/decode_buckets.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from relayrl.model import build_tiny_model, load_causal_lm
from relayrl.rollout import RolloutEngine
from relayrl.rollout.model_runner import ModelRunner
from relayrl.rollout.types import GenerationRequest, SamplingParams

MIXES = [(8, 400, 120), (4, 800, 200), (0, 0, 128)]  # (long rows, their length, short rows)


def ms_per_step(
    model: torch.nn.Module, n_long: int, length: int, n_short: int, overhead: int
) -> float:
    engine = RolloutEngine(model, eos_token_id=2, pad_token_id=0, max_slots=512)
    engine.runner.bucket_overhead = overhead
    prompt = [5, 6, 7, 8, 9, 10]
    for _ in range(n_long):
        engine.submit(
            GenerationRequest(prompt, SamplingParams(max_tokens=length + 100, ignore_eos=True))
        )
    for _ in range(length):
        engine.step()
    for _ in range(n_short):
        engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=60, ignore_eos=True)))
    for _ in range(5):  # admissions done, a few decode steps in
        engine.step()
    k = 30
    t0 = time.perf_counter()
    for _ in range(k):
        engine.step()
    return 1e3 * (time.perf_counter() - t0) / k


def main() -> int:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", hidden_size=96, max_position_embeddings=1024)
        model = load_causal_lm(path, torch.float32).eval()
        default = ModelRunner(0, 1).bucket_overhead
        out: dict[str, object] = {"bench": "decode_buckets", "threads": 1}
        for n_long, length, n_short in MIXES:
            off = ms_per_step(model, n_long, length, n_short, 0)
            on = ms_per_step(model, n_long, length, n_short, default)
            key = f"{n_long}x{length}+{n_short}"
            out[key] = {
                "ms_off": round(off, 3),
                "ms_on": round(on, 3),
                "speedup": round(off / on, 2),
            }
            print(f"{key}: {off:.2f} -> {on:.2f} ms/step", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

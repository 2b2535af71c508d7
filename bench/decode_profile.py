"""Where one decode step's time goes, at several batch sizes (rows decoding at once).

    OMP_NUM_THREADS=1 python bench/decode_profile.py --rows 1 8 64 256 [--profile]

For each row count: ``rows`` requests are admitted (prefilled) into a ``RolloutEngine`` with
``rows`` slots, then ``--steps`` pure decode steps are timed. Prints one JSON line per row
count: ms per decode step, of it the runner's forward (``runner_ms``) and the sampler
(``sample_ms``), and microseconds per row. ``--profile`` adds the top functions by own time
(cProfile) over the timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from relayrl.model.loading import load_causal_lm
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams, split_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16, help="tokens in each row's cache")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--ab", action="store_true", help="alternate GROUPED_DECODE off/on, 5 rounds each"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_model(
            Path(d) / "m", hidden_size=a.hidden, num_layers=a.layers, num_heads=4, num_kv_heads=2
        )
        model = load_causal_lm(path).eval()
        variants = [False, True] * 5 if a.ab else [split_attention.GROUPED_DECODE]
        for rows in a.rows:
            best: dict[bool, list[float]] = {}
            for grouped in variants:
                split_attention.GROUPED_DECODE = grouped
                best.setdefault(grouped, []).append(_one(model, rows, a, grouped))
            if a.ab:
                med = {k: sorted(v)[len(v) // 2] for k, v in best.items()}
                print(
                    json.dumps(
                        {
                            "rows": rows,
                            "median_step_ms_repeat_kv": round(med[False], 3),
                            "median_step_ms_grouped": round(med[True], 3),
                            "speedup": round(med[False] / med[True], 3),
                        }
                    ),
                    flush=True,
                )


def _one(model, rows: int, a: argparse.Namespace, grouped: bool) -> float:
    """One engine at ``rows`` rows: prints its JSON line, returns ms per decode step."""
    eng = RolloutEngine(
        model, eos_token_id=2, pad_token_id=0, max_slots=rows, max_model_len=a.prompt_len + 512
    )
    g = torch.Generator().manual_seed(0)
    for i in range(rows):
        p = torch.randint(4, 80, (a.prompt_len,), generator=g).tolist()
        eng.submit(GenerationRequest(p, SamplingParams(max_tokens=400, ignore_eos=True, seed=i)))
    for _ in range(3):  # admissions + warm-up
        eng.step()
    st0 = dict(eng.stats())
    prof = cProfile.Profile() if a.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(a.steps):
        eng.step()
    if prof:
        prof.disable()
    dt = (time.perf_counter() - t) / a.steps
    st = eng.stats()
    out = {
        "rows": rows,
        "step_ms": round(1e3 * dt, 3),
        "runner_ms": round(1e3 * (st["decode_time_s"] - st0["decode_time_s"]) / a.steps, 3),
        "sample_ms": round(1e3 * (st["sample_time_s"] - st0["sample_time_s"]) / a.steps, 3),
        "us_per_row": round(1e6 * dt / rows, 2),
    }
    out["grouped_decode"] = grouped
    if not a.ab:
        print(json.dumps(out), flush=True)
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    return 1e3 * dt


if __name__ == "__main__":
    main()

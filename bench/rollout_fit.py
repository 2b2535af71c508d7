"""Where a lockstep run's time goes: a least-squares fit of every step's seconds.

``bench/rollout.py``'s lockstep figure (the heavy-tailed engine run over the uniform-length
ceiling, stepped in turn) sits near its ``forward_ratio``. This says why: it steps the two
workloads in turn as ``rollout.run_lockstep`` does and fits each step's CPU seconds as

    t = a * forwards + b * generated tokens + c * prompt tokens + d * cached columns

(``cached columns``: the sum over the step's decode rows of the tokens in their slot, what
their attention reads). Per workload it prints the fitted parts per run (ms), the residual,
and two ratios of the ceiling's parts over the engine's: ``forward_part_ratio`` (a * its
forwards: the forward ratio) and ``token_part_ratio`` (everything else, per-token work and
the residual: the figure an engine whose forwards had no fixed cost would reach on this
workload). ``time_ratio``, the ceiling's seconds per run over the engine's (the lockstep
figure, in time), is a mix of the two, weighted by the per-forward share. Prints ONE JSON line.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/rollout_fit.py [--runs 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollout as bench  # noqa: E402

from relayrl.model.loading import load_causal_lm  # noqa: E402
from relayrl.model.tiny import build_tiny_model  # noqa: E402

TERMS = ("forward", "generated_token", "prompt_token", "cached_column")


def lockstep_steps(
    model, workloads, runs: int, slots: int, max_len: int
) -> tuple[list[np.ndarray], list[int]]:
    """Per workload, one row per step of its completed runs (the four terms and the step's
    CPU seconds), and its completed runs. Stepped in turn like ``rollout.run_lockstep``;
    ``workloads[0]`` leads."""
    state = [{"w": w, "done": 0, "rows": [], "cur": []} for w in workloads]

    def start(s: dict) -> None:
        s["engine"] = bench.engine_with(model, *s["w"], slots, max_len)
        s["cur"] = []

    for s in state:
        start(s)
    lead, rnd = state[0], 0
    while lead["done"] < runs:
        for s in state if rnd % 2 == 0 else state[::-1]:
            if s is not lead and lead["done"] >= runs:
                continue
            eng = s["engine"]
            ctx = sum(len(q.tokens) for q in eng.scheduler.running.values())
            st0 = eng.stats()
            ts = time.process_time()
            eng.step()
            dt = time.process_time() - ts
            st1 = eng.stats()
            s["cur"].append(
                [
                    st1["forwards"] - st0["forwards"],
                    st1["tokens_generated"] - st0["tokens_generated"],
                    st1["prefill_tokens"] - st0["prefill_tokens"],
                    ctx,
                    dt,
                ]
            )
            if not eng.has_unfinished():
                s["done"] += 1
                s["rows"] += s["cur"]
                if s is not lead or s["done"] < runs:
                    start(s)
        rnd += 1
    return [np.array(s["rows"], dtype=np.float64).reshape(-1, 5) for s in state], [
        s["done"] for s in state
    ]


def fit(steps: list[np.ndarray], done: list[int]) -> dict:
    """The least-squares coefficients over both workloads' steps, and per workload its
    parts per run (ms)."""
    rows = np.concatenate(steps)
    coef, *_ = np.linalg.lstsq(rows[:, :4], rows[:, 4], rcond=None)
    out: dict = {f"{t}_us": round(1e6 * c, 4) for t, c in zip(TERMS, coef, strict=True)}
    parts = []
    for name, r, n in zip(("engine", "ceiling"), steps, done, strict=True):
        fitted = r[:, :4] * coef
        p = {t: 1e3 * fitted[:, i].sum() / n for i, t in enumerate(TERMS)}
        p["total"] = 1e3 * r[:, 4].sum() / n
        p["residual"] = p["total"] - sum(p[t] for t in TERMS)
        out[name + "_ms_per_run"] = {k: round(v, 1) for k, v in p.items()}
        parts.append(p)
    eng, ceil = parts
    rest = [p["total"] - p["forward"] for p in parts]
    out["forward_share_engine"] = round(eng["forward"] / eng["total"], 3)
    out["forward_part_ratio"] = round(ceil["forward"] / eng["forward"], 3)
    out["token_part_ratio"] = round(rest[1] / rest[0], 3)
    out["time_ratio"] = round(ceil["total"] / eng["total"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--median", type=float, default=24.0)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--runs", type=int, default=6, help="engine runs (the ceiling restarts)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    max_len = 32 + args.cap + 1
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "m",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=max_len,
        )
        model = load_causal_lm(path).eval()
        prompts, targets = bench.workload(args.requests, args.median, 1.0, args.cap, 0)
        bench.run_engine(model, prompts[:8], [4] * 8, args.slots, max_len)  # warm-up
        mean_len = max(1, round(sum(targets) / len(targets)))
        steps, done = lockstep_steps(
            model,
            [(prompts, targets), (prompts, [mean_len] * len(prompts))],
            args.runs,
            args.slots,
            max_len,
        )
    out = {"bench": "rollout_fit", "requests": args.requests, "runs": done}
    out.update(fit(steps, done))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The simulator on lecture 19's §2 set-up, printing ONE JSON line of figures.

1.5B model (Qwen2.5-1.5B shapes), 16 H100 (async: 12 generate, 4 train unless swept), 512
samples per step, prompts of 256 tokens, lognormal answers (median 2000, cap 16384, sigma
0.8 unless swept). Figures are speedups of steady-state samples/s over colocated sync:

- ``overlap``: one-step overlap;
- ``eta``: async with eta in {0, 1, 2, 4, 8, inf} (interrupt on), with max staleness;
- ``split``: async eta=4 with 1/2/4/6/8 training devices;
- ``sigma``: async eta=4 gain for sigma in {0.2, 0.5, 0.8, 1.1, 1.4};
- ``tail_vs_equal``: sync generation time, long tail vs every answer at the mean length.

    .venv/bin/python bench/plan_directions.py [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from relayrl.plan import (
    ConstantLengths,
    LognormalLengths,
    RooflineTimeModel,
    SimConfig,
    get_hardware,
    get_model,
    simulate,
    speedup,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    tm = RooflineTimeModel(get_model("qwen2.5-1.5b"), get_hardware("h100"))

    def run(lengths, **kw):
        cfg = dict(
            time_model=tm,
            lengths=lengths,
            n_devices=16,
            batch_size=512,
            n_steps=args.steps,
            prompt_len=256,
            seed=args.seed,
        )
        cfg.update(kw)
        return simulate(SimConfig(**cfg))

    tail = LognormalLengths(2000, 0.8, 16384)
    sync = run(tail, schedule="sync")
    out: dict[str, object] = {
        "sync_generation_share": round(
            sync.breakdown["generate_s"]
            / (sync.breakdown["generate_s"] + sync.breakdown["train_s"]),
            3,
        ),
        "sync_low_utilisation_share": round(sync.low_utilisation_share, 3),
        "overlap": round(speedup(run(tail, schedule="overlap", train_devices=4), sync), 3),
    }
    etas = {}
    for eta in (0, 1, 2, 4, 8, None):
        r = run(tail, schedule="async", train_devices=4, eta=eta)
        etas["inf" if eta is None else str(eta)] = [round(speedup(r, sync), 3), r.max_staleness]
    out["eta"] = etas
    out["eta2_no_interrupt"] = round(
        speedup(run(tail, schedule="async", train_devices=4, eta=2, interrupt=False), sync), 3
    )
    out["split"] = {
        str(k): round(speedup(run(tail, schedule="async", train_devices=k, eta=4), sync), 3)
        for k in (1, 2, 4, 6, 8)
    }
    sig = {}
    for s in (0.2, 0.5, 0.8, 1.1, 1.4):
        lengths = LognormalLengths(2000, s, 16384)
        sig[str(s)] = round(
            speedup(
                run(lengths, schedule="async", train_devices=4, eta=4),
                run(lengths, schedule="sync"),
            ),
            3,
        )
    out["sigma"] = sig
    tm7 = RooflineTimeModel(get_model("qwen2.5-7b"), get_hardware("h100"), max_batch_per_device=64)
    t7 = LognormalLengths(968, LognormalLengths.sigma_for_mean(968, 1274), 4096)
    mean = int(round(t7.sample(1024, np.random.default_rng(args.seed)).mean()))
    kw = dict(
        schedule="sync", n_devices=16, batch_size=1024, n_steps=1, prompt_len=256, seed=args.seed
    )
    a = simulate(SimConfig(tm7, t7, **kw))
    b = simulate(SimConfig(tm7, ConstantLengths(mean), **kw))
    out["tail_vs_equal"] = {
        "tail_s": round(a.breakdown["generate_s"], 2),
        "equal_s": round(b.breakdown["generate_s"], 2),
        "ratio": round(a.breakdown["generate_s"] / b.breakdown["generate_s"], 3),
        "low_utilisation_share": round(a.low_utilisation_share, 3),
    }
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

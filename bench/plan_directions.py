"""The simulator on lecture 19's §2 set-up, printing ONE JSON line of figures.

1.5B model (Qwen2.5-1.5B shapes), 16 H100 (async: 12 generate, 4 train unless swept), 512
samples per step, prompts of 256 tokens, lognormal answers (median 2000, cap 16384, sigma
0.8 unless swept). Figures are speedups of steady-state samples/s over colocated sync, for
async in both of its modes: ``in_order`` (the default, ``async.in_order: true``: step k trains
the samples admitted for it, every token at most eta versions old) and ``finish_order``
(AReaL's buffer, ``--finish-order``: the oldest finished samples, faster and staler):

- ``overlap``: one-step overlap;
- ``async.<mode>.eta``: eta in {0, 1, 2, 4, 8, inf} (interrupt on): [speedup, max staleness];
- ``async.<mode>.eta2_no_interrupt``: eta = 2 without interrupts;
- ``async.<mode>.split``: eta = 4 with 1/2/4/6/8 training devices;
- ``async.<mode>.sigma``: eta = 4 gain for sigma in {0.2, 0.5, 0.8, 1.1, 1.4};
- ``tail_vs_equal``: sync generation time, long tail vs every answer at the mean length.

docs/plan.md's table of the directions is this output at 16 steps (a slow test checks it).

    .venv/bin/python bench/plan_directions.py [--steps 16] [--modes in_order,finish_order]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

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

MODES = {"in_order": True, "finish_order": False}


def directions(
    steps: int = 16,
    seed: int = 0,
    modes: tuple[str, ...] = ("in_order", "finish_order"),
    quick: bool = False,
) -> dict[str, Any]:
    """The figures above; ``quick`` sweeps one value per direction (a smoke test)."""
    tm = RooflineTimeModel(get_model("qwen2.5-1.5b"), get_hardware("h100"))

    def run(lengths, **kw):
        cfg = dict(
            time_model=tm,
            lengths=lengths,
            n_devices=16,
            batch_size=512,
            n_steps=steps,
            prompt_len=256,
            seed=seed,
        )
        cfg.update(kw)
        return simulate(SimConfig(**cfg))

    tail = LognormalLengths(2000, 0.8, 16384)
    sync = run(tail, schedule="sync")
    out: dict[str, Any] = {
        "sync_generation_share": round(
            sync.breakdown["generate_s"]
            / (sync.breakdown["generate_s"] + sync.breakdown["train_s"]),
            3,
        ),
        "sync_low_utilisation_share": round(sync.low_utilisation_share, 3),
        "overlap": round(speedup(run(tail, schedule="overlap", train_devices=4), sync), 3),
        "async": {},
    }
    etas = (0, None) if quick else (0, 1, 2, 4, 8, None)
    splits = (4,) if quick else (1, 2, 4, 6, 8)
    sigmas = (0.8,) if quick else (0.2, 0.5, 0.8, 1.1, 1.4)
    sync_by_sigma = {s: run(LognormalLengths(2000, s, 16384), schedule="sync") for s in sigmas}
    for mode in modes:
        kw = dict(schedule="async", in_order=MODES[mode])
        m: dict[str, Any] = {}
        m["eta"] = {}
        for eta in etas:
            r = run(tail, train_devices=4, eta=eta, **kw)
            m["eta"]["inf" if eta is None else str(eta)] = [
                round(speedup(r, sync), 3),
                r.max_staleness,
            ]
        m["eta2_no_interrupt"] = round(
            speedup(run(tail, train_devices=4, eta=2, interrupt=False, **kw), sync), 3
        )
        m["split"] = {
            str(k): round(speedup(run(tail, train_devices=k, eta=4, **kw), sync), 3) for k in splits
        }
        m["sigma"] = {
            str(s): round(
                speedup(
                    run(LognormalLengths(2000, s, 16384), train_devices=4, eta=4, **kw),
                    sync_by_sigma[s],
                ),
                3,
            )
            for s in sigmas
        }
        out["async"][mode] = m
    if not quick:
        tm7 = RooflineTimeModel(
            get_model("qwen2.5-7b"), get_hardware("h100"), max_batch_per_device=64
        )
        t7 = LognormalLengths(968, LognormalLengths.sigma_for_mean(968, 1274), 4096)
        mean = int(round(t7.sample(1024, np.random.default_rng(seed)).mean()))
        kw7 = dict(
            schedule="sync", n_devices=16, batch_size=1024, n_steps=1, prompt_len=256, seed=seed
        )
        a = simulate(SimConfig(tm7, t7, **kw7))
        b = simulate(SimConfig(tm7, ConstantLengths(mean), **kw7))
        out["tail_vs_equal"] = {
            "tail_s": round(a.breakdown["generate_s"], 2),
            "equal_s": round(b.breakdown["generate_s"], 2),
            "ratio": round(a.breakdown["generate_s"] / b.breakdown["generate_s"], 3),
            "low_utilisation_share": round(a.low_utilisation_share, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="in_order,finish_order", help="comma list")
    args = ap.parse_args()
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {', '.join(bad)}; use in_order, finish_order")
    t0 = time.perf_counter()
    out = directions(args.steps, args.seed, modes)
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

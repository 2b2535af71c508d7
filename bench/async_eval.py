"""The trainer's busy fraction in ``schedule=async`` with and without a held-out evaluation
every ``--every`` steps: evaluation beside training on the rollout engine (``eval.background:
true``, the default), beside training on an engine of its own (``eval.replica: separate``),
the trainer waiting for it (``eval.background: false``) and no evaluation at all, one after the
other in the same process.

busy = sum of the steps' ``time/train`` / the wall time from the end of the evaluation before
training to the start of the one after it (both timed by wrapping ``held_out_metrics``; they
are the same in every mode). The window spans the same steps in every mode, so ``wall_vs_none_
<mode>`` (its wall time over no evaluation's) is what the evaluation cost training in time: a
busy fraction near no evaluation's with a longer wall time means the trainer's own steps were
slowed (an evaluation engine sharing the trainer's cores or device). A tiny model on the
CPU, ``--steps`` steps; prints one JSON line.

    OMP_NUM_THREADS=1 PYTHONPATH=src:tests python bench/async_eval.py --steps 20 --every 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import relayrl.controller.trainer as trainer_mod  # noqa: E402
from relayrl.cluster.local import build_local_roles  # noqa: E402
from relayrl.config import RunConfig, load_config  # noqa: E402
from relayrl.model import build_tiny_model  # noqa: E402


def run(model: Path, root: Path, mode: str, steps: int, every: int, eval_size: int) -> dict:
    calls: list[tuple[float, float, bool]] = []  # (start, end, in the main thread)
    inner = trainer_mod.held_out_metrics

    def timed(*args: Any, **kwargs: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        main = threading.current_thread() is threading.main_thread()
        calls.append((t0, time.perf_counter(), main))
        return out

    trainer_mod.held_out_metrics = timed  # type: ignore[assignment]
    try:
        cfg = load_config(
            RunConfig,
            None,
            [
                f"model.path={model}",
                f"run_dir={root / mode}",
                "threads=1",
                "logging.progress=false",
                "logging.tensorboard=false",
                "schedule=async",
                f"train.steps={steps}",
                "train.save_every=0",
                f"train.eval_every={0 if mode == 'none' else every}",
                f"eval.background={mode != 'waited'}",
                f"eval.replica={'separate' if mode == 'separate' else 'shared'}",
                f"data.eval_size={eval_size}",
                "rollout.max_tokens=16",
                "algo.prompts_per_step=4",
                "algo.group_size=4",
            ],
        )
        trainer_mod.train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    finally:
        trainer_mod.held_out_metrics = inner  # type: ignore[assignment]
    records = [json.loads(x) for x in (root / mode / "metrics.jsonl").read_text().splitlines()]
    train_s = sum(r.get("time/train", 0.0) for r in records)
    main_calls = [c for c in calls if c[2]]
    window = main_calls[-1][0] - main_calls[0][1]  # first eval's end -> last eval's start
    evals = [c for c in calls[1:-1]]
    return {
        "busy_frac": round(train_s / window, 4),
        "wall_s": round(window, 2),
        "train_s": round(train_s, 2),
        "evals": len(evals),
        "eval_s": round(sum(e - s for s, e, _ in evals), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="relayrl-async-eval-"))
    model = build_tiny_model(root / "m", hidden_size=args.hidden, seed=0)
    out: dict[str, Any] = {"steps": args.steps, "every": args.every, "eval_size": args.eval_size}
    for mode in ("none", "background", "separate", "waited"):
        out[mode] = run(model, root, mode, args.steps, args.every, args.eval_size)
        print(mode, out[mode], file=sys.stderr)
    none = out["none"]["busy_frac"]
    out["points_lost_background"] = round(100 * (none - out["background"]["busy_frac"]), 1)
    out["points_lost_separate"] = round(100 * (none - out["separate"]["busy_frac"]), 1)
    out["points_lost_waited"] = round(100 * (none - out["waited"]["busy_frac"]), 1)
    for mode in ("background", "separate", "waited"):  # the same steps: wall time vs none
        out[f"wall_vs_none_{mode}"] = round(out[mode]["wall_s"] / out["none"]["wall_s"], 2)
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

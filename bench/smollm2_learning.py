"""Held-out greedy accuracy of SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic before and
after N GRPO steps of a recipe (default ``configs/grpo_smollm2_arithmetic.yaml``, LoRA), over
seeds, with wall time and CPU seconds.

For each seed: ``relayrl train``'s loop in this process (``relayrl.controller.trainer.train``)
with ``seed``, ``train.steps=N`` and ``data.eval_size=E`` (the held-out problems, never trained
on; greedy, pass = the task's scorer gives 1). One JSON line per seed: accuracy before / after,
wall seconds of the run, mean wall seconds of a step (``time/step``), CPU seconds of the run
(this process's, all threads, plus its finished children's; both evaluations included), the
load average at start. A last line summarises over the seeds.

``--pass-n N`` (0: off) adds ``relayrl eval``'s pass@k / maj@k before and after: the CLI, in its
own process, on the same held-out problems, ``N`` samples per problem at ``--pass-temperature``
(sampling seed ``eval.seed`` = the run's seed, the same requests before and after), ``k`` from
``--pass-k``; before = the fetched model, after = the trained actor of the last step (LoRA: its
merged export, ``model.lora.save_merged``; full: the checkpoint's ``actor`` directory). pass@k
is the unbiased estimator (``relayrl.controller.evaluate.pass_at_k``).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/smollm2_learning.py \
        [--seeds 0,1,2] [--steps 10] [--eval-size 200] [--config CFG] \
        [--pass-n 8 --pass-k 1,4,8 --pass-temperature 1.0] [key=value ...]

Needs ``relayrl models fetch smollm2`` (run here). The weights are Q4_1 dequantised: figures are
this conversion's, not the original model's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def pass_at_k(
    config: Path, seed: int, model_dir: str, eval_size: int, a: argparse.Namespace, out: Path
) -> dict[str, float]:
    """``relayrl eval`` of ``model_dir`` (a plain HF directory, adapters off) in its own
    process: ``--pass-n`` samples on the ``eval_size`` held-out problems of ``seed``; its
    metrics (``pass@k``, ``maj@k``, ``pass_rate``) and the wall / CPU seconds it took."""
    ks = [int(k) for k in a.pass_k.split(",")]
    cmd = [sys.executable, "-m", "relayrl.cli", "eval", str(config), f"model.path={model_dir}",
           "model.lora=null", f"seed={seed}", f"eval.seed={seed}", "threads=1",
           "--n", str(a.pass_n), *[f"--k={k}" for k in ks],
           "--temperature", str(a.pass_temperature), "--limit", str(eval_size),
           "--output", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    t0, c0 = time.perf_counter(), _cpu_s()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    m = json.loads(out.with_suffix(".summary.json").read_text())["held-out"]
    keep = [f"pass@{k}" for k in ks] + [f"maj@{k}" for k in ks] + ["pass_rate", "prompts"]
    return {k: round(float(m[k]), 4) for k in keep} | {
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
    }


def run_seed(
    config: Path, seed: int, steps: int, eval_size: int, extra: list[str], a: argparse.Namespace
) -> dict:
    import torch

    torch.set_num_threads(1)
    from relayrl.cluster.local import build_local_roles
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.trainer import train
    from relayrl.model.fetch import fetch_model

    model = fetch_model("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"model.path={model}",
            f"run_dir={tmp}/run",
            f"seed={seed}",
            f"train.steps={steps}",
            "train.eval_every=0",
            f"data.eval_size={eval_size}",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            *extra,
        ]
        cfg = load_config(RunConfig, config, overrides)
        if a.pass_n:  # the last step's actor on disk, for relayrl eval
            merged = ["model.lora.save_merged=true"] if cfg.model.lora is not None else []
            cfg = load_config(RunConfig, config, [*overrides, f"train.save_every={steps}", *merged])
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), _cpu_s()
        out = train(cfg, lambda act, cri: build_local_roles(cfg, act, cri))
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").open()]
        passk: dict[str, dict[str, float]] = {}
        if a.pass_n:
            ckpt = sorted((Path(tmp) / "run" / "checkpoints").glob("step_*"))[-1]
            trained = ckpt / ("actor_merged" if cfg.model.lora is not None else "actor")
            for name, mdir in (("before", str(model)), ("after", str(trained))):
                passk[name] = pass_at_k(
                    config, seed, mdir, eval_size, a, Path(tmp) / f"eval_{name}.jsonl"
                )
    step_s = [r["time/step"] for r in rows if "time/step" in r]
    return {
        "bench": "smollm2_learning",
        "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
        "seed": seed,
        "steps": steps,
        "eval_size": eval_size,
        "acc_before": out.get("eval_before"),
        "acc_after": out["eval_after"],
        "wall_s": round(wall, 1),
        "step_wall_s_mean": round(statistics.mean(step_s), 1) if step_s else None,
        "cpu_s": round(cpu, 1),
        "load_avg_start": round(load, 1),
        **(
            {"pass_at_k": passk, "pass_n": a.pass_n, "pass_temperature": a.pass_temperature}
            if passk
            else {}
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--config", default=str(ROOT / "configs" / "grpo_smollm2_arithmetic.yaml"))
    ap.add_argument("--pass-n", type=int, default=0, help="relayrl eval samples (0: off)")
    ap.add_argument("--pass-k", default="1,4,8", help="the k of pass@k / maj@k, each <= n")
    ap.add_argument("--pass-temperature", type=float, default=1.0)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    a = ap.parse_args()
    results = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        r = run_seed(Path(a.config).resolve(), seed, a.steps, a.eval_size, a.overrides, a)
        results.append(r)
        print(json.dumps(r), flush=True)
    gains = [r["acc_after"] - r["acc_before"] for r in results if r["acc_before"] is not None]
    print(
        json.dumps(
            {
                "bench": "smollm2_learning",
                "summary": True,
                "seeds": len(results),
                "acc_before_mean": round(statistics.mean(r["acc_before"] for r in results), 4),
                "acc_after_mean": round(statistics.mean(r["acc_after"] for r in results), 4),
                "gain_min": round(min(gains), 4) if gains else None,
                "wall_s_total": round(sum(r["wall_s"] for r in results), 1),
            }
        )
    )


if __name__ == "__main__":
    main()

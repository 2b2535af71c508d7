"""Train / inference mismatch experiment: does the ``rollout_corr/*`` monitor see a controlled
mismatch, and does a rollout correction (TIS / MIS / IcePop) keep GRPO training where no
correction degrades?

Three controlled mismatches between the engine that samples and the trainer that computes
the loss, on the tiny SFT-warm-started model (2-digit addition, as the integration tests):
- ``engine-temperature``: the engine samples at ``--engine-temperature`` (default 1.5; the
  issue-21 table uses 2.0) while the trainer and the reference score at 1.0, a bench-only
  skew (``rollout.temperature`` = T_e for the requests, the actor's and reference's
  ``temperature`` set back to 1.0 after the roles are built);
- ``temperature``: the engine samples at 1.0 while the trainer (and the reference) compute
  logprobs at ``--trainer-temperature`` (default 0.7);
- ``bf16``: the sync engine's copy of the weights is bfloat16 (the trainer stays fp32), the
  mismatch a vLLM engine brings.
Each configuration runs sync GRPO from the same SFT model and seed with
``recompute_old_logprobs: always`` (so the monitor has the trainer's logprobs even without a
correction). One JSON line per run goes to stderr (held-out greedy pass rate before / after,
mean mismatch stats over the steps, fraction of tokens the correction touched), then ONE JSON
line on stdout: per configuration, the per-seed figures and the mean gain. ``--figures DIR``
writes ``mismatch_monitor.png`` and ``mismatch_training.png`` (first seed) there.

    .venv/bin/python bench/mismatch.py --only 0,7,8,10,11 --engine-temperature 2.0 --seeds 0,1,2
    .venv/bin/python bench/mismatch.py --steps 60 --figures docs/figures
    .venv/bin/python bench/mismatch.py --quick      # 3 configurations, 20 steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, DataConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer

ARITH = {"min_operand": 0, "max_operand": 99, "operators": ["+"], "num_operands": 2}
RC = "algo.rollout_correction"
CONFIGS: list[tuple[str, str | None, list[str]]] = [
    ("matched, no correction", None, []),
    ("temperature, no correction", "temperature", []),
    ("temperature, TIS token cap 2", "temperature", [f"{RC}.mode=tis"]),
    ("temperature, MIS seq [0.5, 2]", "temperature", [f"{RC}.mode=mis", f"{RC}.level=sequence"]),
    ("temperature, IcePop [0.5, 2]", "temperature", [f"{RC}.mode=icepop"]),
    ("bf16 engine, no correction", "bf16", []),
    ("bf16 engine, TIS token cap 2", "bf16", [f"{RC}.mode=tis"]),
    ("engine T, no correction", "engine-temperature", []),
    ("engine T, TIS token cap 2", "engine-temperature", [f"{RC}.mode=tis"]),
    (
        "engine T, MIS seq [0.5, 2]",
        "engine-temperature",
        [f"{RC}.mode=mis", f"{RC}.level=sequence"],
    ),
    ("engine T, IcePop [0.5, 2]", "engine-temperature", [f"{RC}.mode=icepop"]),
    ("engine T, MIS token [0.5, 2]", "engine-temperature", [f"{RC}.mode=mis"]),
]
QUICK = [0, 1, 2]
MONITOR = ("logp_diff_abs_mean", "logp_diff_abs_max", "beyond_threshold_frac", "kl_k3")


def sft_model(root: Path, seed: int) -> Path:
    """The integration tests' warm start: tiny Llama, SFT until 35% greedy validation pass."""
    base = build_tiny_model(root / "base", hidden_size=96, seed=seed)
    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    held_out = {p.record.prompt for p in PromptSource(data, load_tokenizer(base), seed).eval_set()}
    cfg = SFTConfig(
        seed=seed, model_path=str(base), output_dir=str(root / "sft"),
        arithmetic=ArithmeticConfig(**ARITH), steps=3000, eval_every=20, eval_size=200,
        target_pass_rate=0.35, threads=1, progress=False,
    )  # fmt: skip
    run_sft(cfg, exclude_prompts=held_out)  # the RL held-out set stays unseen
    return root / "sft"


def run(model: Path, run_dir: Path, mismatch: str | None, overrides: list[str], args) -> dict:
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}", f"run_dir={run_dir}", f"seed={args.seed}", "threads=1",
            "logging.progress=false", "logging.tensorboard=false", f"train.steps={args.steps}",
            "data.eval_size=200", "algo.recompute_old_logprobs=always",
            f"{RC}.mismatch_threshold=0.1", f"optim.lr={args.lr}",
            *([f"rollout.temperature={args.engine_temperature}"]
              if mismatch == "engine-temperature" else []),
            *overrides,
        ],
    )  # fmt: skip

    def build(actor: str, critic: str | None):
        roles = build_local_roles(cfg, actor, critic)
        if mismatch == "engine-temperature":  # the engine samples at T_e, the trainer T = 1
            roles.actor.temperature = 1.0
            if roles.reference is not None:
                roles.reference.temperature = 1.0
        elif mismatch == "temperature":
            roles.actor.temperature = args.trainer_temperature
            if roles.reference is not None:
                roles.reference.temperature = args.trainer_temperature
        elif mismatch == "bf16":
            roles.rollout.model.to(torch.bfloat16)  # later weight syncs cast into bf16
        return roles

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # the run's tables: stdout keeps one line
        out = train(cfg, build)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "actor/loss" in r]
    series = {k: [r.get(f"rollout_corr/{k}", 0.0) for r in steps] for k in MONITOR}
    series["pass_rate"] = [r["pass_rate"] for r in steps]
    series["affected_frac"] = [r.get("rollout_corr/affected_frac", 0.0) for r in steps]
    return {
        "eval_before": out["eval_before"],
        "eval_after": out["eval_after"],
        **{f"{k}_mean": statistics.fmean(v) for k, v in series.items()},
        "train_pass_last10": statistics.fmean(series["pass_rate"][-10:]),
        "seconds": round(time.perf_counter() - t0, 1),
        "_series": series,
    }


def figures(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for name, key, ylabel in (
        ("mismatch_monitor.png", "logp_diff_abs_mean", "mean |trainer - engine| logprob"),
        ("mismatch_training.png", "pass_rate", "training pass rate (5-step mean)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, res in results.items():
            y = res["_series"][key]
            if key == "pass_rate":
                y = [statistics.fmean(y[max(0, i - 4) : i + 1]) for i in range(len(y))]
            ax.plot(range(1, len(y) + 1), y, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", help="comma-separated seeds (default: --seed)")
    p.add_argument("--trainer-temperature", type=float, default=0.7)
    p.add_argument("--engine-temperature", type=float, default=1.5)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--model", type=Path, help="SFT model dir (default: build the warm start)")
    p.add_argument("--models", help="SFT model dir per seed, with {seed} (e.g. m{seed}/sft)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="comma-separated indices into CONFIGS (default: all)")
    p.add_argument("--figures", type=Path)
    args = p.parse_args()
    if args.quick:
        args.steps = min(args.steps, 20)
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(CONFIGS))
    configs = [CONFIGS[i] for i in (QUICK if args.quick else chosen)]
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    results: dict[str, dict[int, dict]] = {label: {} for label, _, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in seeds:
            args.seed = seed
            if args.models:
                model = Path(args.models.format(seed=seed))
            else:
                model = args.model or sft_model(root / f"model{seed}", seed)
            for i, (label, mismatch, overrides) in enumerate(configs):
                res = run(model, root / f"run{seed}_{i}", mismatch, overrides, args)
                results[label][seed] = res
                line = {"config": label, "seed": seed}
                line.update({k: v for k, v in res.items() if k != "_series"})
                print(json.dumps(line), file=sys.stderr, flush=True)
    if args.figures:
        figures({k: v[seeds[0]] for k, v in results.items()}, args.figures)
    keys = ("eval_before", "eval_after", "logp_diff_abs_mean_mean", "beyond_threshold_frac_mean",
            "kl_k3_mean", "affected_frac_mean", "train_pass_last10")  # fmt: skip
    table = {}
    for label, per_seed in results.items():
        row: dict = {"seeds": list(per_seed)}
        row.update({k: [float(f"{r[k]:.4g}") for r in per_seed.values()] for k in keys})
        gains = [r["eval_after"] - r["eval_before"] for r in per_seed.values()]
        row["gain_mean"] = round(statistics.fmean(gains), 4)
        table[label] = row
    head = {"bench": "mismatch", "steps": args.steps, "engine_temperature": args.engine_temperature,
            "trainer_temperature": args.trainer_temperature, "lr": args.lr}  # fmt: skip
    print(json.dumps({**head, "configs": table}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

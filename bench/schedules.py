"""Schedules benchmark: sync vs overlap vs async (eta, interrupt, decoupled vs naive PPO).

A heavy-tailed task on the tiny model: 2-digit addition where every SFT response is the answer
followed by a filler of k dots before EOS, k ~ lognormal(median, sigma) capped, so response
lengths have a long tail (the verifier reads the leading integer, so the filler is neutral for
the reward). The warm start has two SFT stages (plain answers to a 30% validation pass rate,
then 200 steps on answer + filler). Defaults: 64 prompts x 8 samples per step, 512 engine
slots (a sync step is one wave, so it waits for its longest answer), cap 400 tokens, RL
learning rate 2.5e-4, dynamic micro-batches of 1024 tokens.
Each configuration runs GRPO from the same SFT model with the same seed and the same sample
budget (steps x prompts x G) and reports samples/s and response tokens/s over the training
loop (the answers' lengths drift differently per configuration, so tokens/s is the fairer
throughput figure), the trainer's idle fraction, engine busy fraction and slot utilisation,
token staleness (mean / max / fraction beyond eta) and the held-out greedy pass rate at the end.
``ceiling x sync`` is sync's seconds per step over the row's training seconds per step: what
the row would reach if generation were hidden entirely behind training (overlap and async give
the trainer one of the two cores, so on this machine it bounds them; `--train-threads 2`
oversubscribes the cores instead: measured slower).

Prints one JSON line per configuration (first a ``config`` line for
``bench/plan_calibration.py``), then a table, then one summary JSON line with the ratios that
the issue's goals are stated in (async eta=2 over sync; decoupled vs naive at large staleness).

    .venv/bin/python bench/schedules.py            # full set (~15 min on 2 cores)
    .venv/bin/python bench/schedules.py --quick    # sync, overlap, async eta=2 only
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data import ArithmeticTask, write_jsonl
from relayrl.model import build_tiny_model

CONFIGS: list[tuple[str, list[str]]] = [
    ("sync", ["schedule=sync"]),
    ("overlap", ["schedule=overlap"]),
    ("async eta=0", ["schedule=async", "async.eta=0"]),
    ("async eta=1", ["schedule=async", "async.eta=1"]),
    ("async eta=2", ["schedule=async", "async.eta=2"]),
    ("async eta=4", ["schedule=async", "async.eta=4"]),
    ("async eta=inf", ["schedule=async", "async.eta=null"]),
    ("async eta=2 no-interrupt", ["schedule=async", "async.eta=2", "async.interrupt=false"]),
    ("async eta=2 finish-order", ["schedule=async", "async.eta=2", "async.in_order=false"]),
    (
        "async eta=2 finish-order drop>2",
        [
            "schedule=async",
            "async.eta=2",
            "async.in_order=false",
            "async.max_token_staleness=2",
            "async.stale_tokens=drop",
        ],
    ),
    (
        "async eta=2 finish-order drop>2 no-interrupt",
        [
            "schedule=async",
            "async.eta=2",
            "async.in_order=false",
            "async.max_token_staleness=2",
            "async.stale_tokens=drop",
            "async.interrupt=false",
        ],
    ),
    # DAPO dynamic sampling: sync refills in rounds; async drops as groups finish
    ("sync dynamic sampling", ["schedule=sync", "data.dynamic_sampling.enabled=true"]),
    (
        "async eta=2 dynamic sampling",
        ["schedule=async", "async.eta=2", "data.dynamic_sampling.enabled=true"],
    ),
    ("async eta=8 decoupled", ["schedule=async", "async.eta=8", "algo.policy_loss=decoupled_ppo"]),
    ("async eta=8 naive", ["schedule=async", "async.eta=8", "algo.policy_loss=ppo"]),
    # AReaL's ablation makes several PPO updates per batch: that is where the clip's centre
    # (behaviour policy vs proximal policy) matters
    (
        "async eta=8 decoupled 4 minibatches",
        ["schedule=async", "async.eta=8", "algo.policy_loss=decoupled_ppo", "algo.mini_batches=4"],
    ),
    (
        "async eta=8 naive 4 minibatches",
        ["schedule=async", "async.eta=8", "algo.policy_loss=ppo", "algo.mini_batches=4"],
    ),
]
QUICK = {"sync", "overlap", "async eta=2"}


def filler_sft_data(path: Path, n: int, median: float, sigma: float, cap: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for rec in ArithmeticTask(seed=seed + 1, max_operand=99).sft_records(n):
        k = min(cap, int(math.exp(math.log(median) + sigma * rng.gauss(0.0, 1.0))))
        rows.append({"prompt": rec.prompt, "response": rec.response + "." * k})
    write_jsonl(path, rows)


def warm_start(root: Path, args: argparse.Namespace) -> None:
    """Two SFT stages: plain answers until the validation pass rate reaches ``--sft-target``
    (the demo's warm start: the filler would dilute the arithmetic signal ~10x), then
    ``--filler-steps`` on answer + filler so that sampled lengths follow the heavy tail."""
    # room for prompt + the longest filler (the engine and the trainer see the whole sequence)
    context = max(512, 1 << (args.cap + 32 - 1).bit_length())
    base = build_tiny_model(root / "base", hidden_size=96, max_position_embeddings=context)
    held_out = {r.prompt for r in ArithmeticTask(max_operand=99).held_out(200, seed=0)}
    rows = ArithmeticTask(seed=7, max_operand=99).sample(400)
    val = root / "val.jsonl"  # a validation stream disjoint from the RL held-out set
    write_jsonl(val, [r for r in rows if r.prompt not in held_out][:200])
    common = dict(eval_every=25, val_path=str(val), threads=2, progress=False)
    answers = SFTConfig(
        model_path=str(base),
        output_dir=str(root / "sft_answers"),
        arithmetic=ArithmeticConfig(max_operand=99),
        steps=args.sft_steps,
        target_pass_rate=args.sft_target,
        **common,
    )
    out = run_sft(answers, exclude_prompts=held_out)
    print(json.dumps({"sft_answers": out}), flush=True)
    data = root / "sft_filler.jsonl"
    filler_sft_data(data, 20000, args.median, args.sigma, args.cap, seed=0)
    filler = SFTConfig(
        model_path=str(root / "sft_answers"),
        output_dir=str(root / "sft"),
        task="jsonl",
        train_path=str(data),
        steps=args.filler_steps,
        batch_size=args.filler_batch,
        lr=args.filler_lr,
        warmup_steps=0,
        threads=2,
        progress=False,
    )
    out = run_sft(filler)
    print(json.dumps({"sft_filler": out}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=64, help="prompt groups per step (B)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--median", type=float, default=12.0)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--cap", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=3000, help="at most (stops at --sft-target)")
    ap.add_argument("--filler-steps", type=int, default=200, help="SFT steps on answer + filler")
    ap.add_argument(
        "--filler-batch",
        type=int,
        default=64,
        help="batch of the filler stage (rows padded to "
        "the longest: 16 keeps a --cap 1000 warm start to minutes)",
    )
    ap.add_argument(
        "--filler-lr",
        type=float,
        default=3e-3,
        help="learning rate of the filler stage (lower "
        "keeps the arithmetic when the filler is long: it is most of every response's tokens)",
    )
    ap.add_argument("--sft-target", type=float, default=0.3, help="SFT validation pass rate")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=1024,
        help="dynamic micro-batches (all configs; 1024 measured ~8%% faster than 2048 on one "
        "thread, the same on two)",
    )
    ap.add_argument("--slots", type=int, default=0, help="engine slots (0: prompts x group)")
    ap.add_argument(
        "--lr",
        type=float,
        default=2.5e-4,
        help="RL learning rate (at 5e-4 sync ended at 48%% and the answers' lengths swung "
        "apart between schedules; at 2.5e-4 every schedule learned more: measured)",
    )
    ap.add_argument("--kl", type=float, default=0.0, help="GRPO k3 KL loss coefficient")
    ap.add_argument("--sync-threads", type=int, default=2, help="threads of the sync process")
    ap.add_argument(
        "--train-threads", type=int, default=1, help="threads of the trainer in overlap / async"
    )
    ap.add_argument(
        "--urgent-steps",
        type=int,
        default=None,
        help="async.urgent_steps of overlap / async (default: the config's)",
    )
    ap.add_argument("--seed", type=int, default=0, help="RL seed (prompts, sampling, shuffling)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="relayrl-sched-"))
    if not (root / "sft" / "config.json").exists():  # a --workdir from an earlier run is reused
        warm_start(root, args)
    slots = args.slots or args.prompts * args.group
    meta = {
        "config": {
            "batch_size": args.prompts * args.group,
            "n_steps": args.steps,
            "prompt_len": 6,
            "lengths": f"lognormal:{args.median + 4}:{args.sigma}:{args.cap + 4}",
            "slots": slots,
            "threads": 2,
            "train_threads": args.train_threads,
        }
    }
    print(json.dumps(meta), flush=True)
    rows = []
    for name, overrides in CONFIGS:
        if args.quick and name not in QUICK:
            continue
        if args.only and name not in {x.strip() for x in args.only.split(",")}:
            continue
        threads = (
            f"threads={args.sync_threads}"
            if "schedule=sync" in overrides
            else f"threads={args.train_threads}"
        )
        cfg: RunConfig = load_config(
            RunConfig,
            None,
            [
                f"model.path={root / 'sft'}",
                f"run_dir={root / name.replace(' ', '_')}_s{args.seed}",
                threads,
                "rollout.threads=1",
                f"rollout.max_slots={slots}",
                f"optim.lr={args.lr}",
                f"seed={args.seed}",
                f"algo.kl_coef={args.kl}",
                f"rollout.max_tokens={args.cap + 4}",
                f"algo.prompts_per_step={args.prompts}",
                f"algo.group_size={args.group}",
                *([] if any("mini_batches" in o for o in overrides) else ["algo.mini_batches=1"]),
                f"algo.micro_batch_tokens={args.micro_batch_tokens}",
                f"train.steps={args.steps}",
                "data.eval_size=200",
                "logging.progress=false",
                "logging.tensorboard=false",
                *([] if args.urgent_steps is None else [f"async.urgent_steps={args.urgent_steps}"]),
                *overrides,
            ],
        )
        t0 = time.perf_counter()
        out = train(cfg, lambda a, c, cfg=cfg: build_local_roles(cfg, a, c))
        wall = time.perf_counter() - t0
        hist = [
            json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r for r in hist if "reward_mean" in r]
        loop_s = sum(r["time/step"] for r in steps)
        hist = {int(k): v for k, v in out.get("staleness_hist", {}).items()}
        n_tok = max(sum(hist.values()), 1)
        eta = cfg.staleness_eta if cfg.schedule != "sync" else 0
        engine = out.get("engine", {})  # the async engine's counters (sync: none)
        row = {
            "name": name,
            "schedule": cfg.schedule,
            "eta": cfg.staleness_eta if cfg.schedule != "sync" else None,
            "interrupt": cfg.interrupt,
            "in_order": cfg.async_.in_order,
            "policy_loss": cfg.policy_loss,
            "samples_per_s": args.steps * args.prompts * args.group / loop_s,
            # response tokens trained per second: independent of how long the answers became
            "response_tokens_per_s": sum(r["response_length_mean"] for r in steps)
            * args.prompts
            * args.group
            / loop_s,
            "trainer_idle_frac": steps[-1].get("trainer_idle_frac"),
            "engine_utilisation": steps[-1].get(
                "engine_busy_frac", steps[-1].get("engine_slot_utilisation")
            ),
            "engine_slot_utilisation": (
                sum(r.get("engine_slot_utilisation", 0.0) for r in steps) / len(steps)
                if cfg.schedule == "sync"  # per step; async reports the engine's running mean
                else steps[-1].get("engine_slot_utilisation")
            ),
            "staleness_max": max(r.get("staleness_max", 0.0) for r in steps),
            "staleness_mean": sum(k * v for k, v in hist.items()) / n_tok,
            "tokens_over_eta_frac": (
                sum(v for k, v in hist.items() if k > eta) / n_tok if eta is not None else 0.0
            ),
            "response_length_mean": sum(r["response_length_mean"] for r in steps) / len(steps),
            "pass_before": out["eval_before"],
            "pass_after": out["eval_after"],
            # engine steps that decoded only the groups the in-order trainer waited for
            "engine_urgent_step_frac": engine.get("urgent_steps", 0)
            / max(engine.get("steps", 0), 1),
            "loop_s": loop_s,
            "step_s": loop_s / len(steps),
            # the trainer's own seconds per step: a schedule that overlaps generation entirely
            # still takes this long, so sync's step_s / this is its ceiling over sync
            "train_s_per_step": sum(r["time/train"] for r in steps) / len(steps),
            # generated tokens per second of generation time (sync: per step, the whole wave
            # on 2 threads; async: the engine's running figure on its own thread)
            "gen_tokens_per_s": (
                sum(r["gen_tokens_per_s"] for r in steps) / len(steps)
                if cfg.schedule == "sync"
                else steps[-1].get("gen_tokens_per_s")
            ),
            "wall_s": wall,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    table = Table(title="schedules (same seed, same sample budget)")
    for col in (
        "name",
        "samples/s",
        "x sync",
        "resp tok/s",
        "x sync (tok)",
        "idle %",
        "train s/step",
        "ceiling x sync",
        "engine busy",
        "slot util",
        "stale mean/max",
        "> eta %",
        "pass after",
    ):
        table.add_column(col)
    sync = next((r for r in rows if r["name"] == "sync"), rows[0])
    for r in rows:
        table.add_row(
            r["name"],
            f"{r['samples_per_s']:.1f}",
            f"{r['samples_per_s'] / sync['samples_per_s']:.2f}",
            f"{r['response_tokens_per_s']:.0f}",
            f"{r['response_tokens_per_s'] / sync['response_tokens_per_s']:.2f}",
            "" if r["trainer_idle_frac"] is None else f"{100 * r['trainer_idle_frac']:.0f}",
            f"{r['train_s_per_step']:.3f}",
            "" if r["schedule"] == "sync" else f"{sync['step_s'] / r['train_s_per_step']:.2f}",
            "" if r["engine_utilisation"] is None else f"{r['engine_utilisation']:.2f}",
            "" if r["engine_slot_utilisation"] is None else f"{r['engine_slot_utilisation']:.2f}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']:.0f}",
            f"{100 * r['tokens_over_eta_frac']:.1f}",
            f"{100 * r['pass_after']:.1f}%",
        )
    Console(file=sys.stderr, width=200).print(table)
    by = {r["name"]: r for r in rows}
    summary = {"bench": "schedules"}
    if "async eta=2" in by:
        summary["async_eta2_over_sync"] = by["async eta=2"]["samples_per_s"] / sync["samples_per_s"]
        summary["async_eta2_pass_minus_sync"] = by["async eta=2"]["pass_after"] - sync["pass_after"]
        # with generation entirely hidden behind training, async is trainer-bound at this
        summary["async_eta2_ceiling_over_sync"] = (
            sync["step_s"] / by["async eta=2"]["train_s_per_step"]
        )
        # ... and engine-bound at this: one step's answers at the engine's own rate
        a2 = by["async eta=2"]
        gen_s = a2["response_length_mean"] * args.prompts * args.group / a2["gen_tokens_per_s"]
        summary["async_eta2_engine_ceiling_over_sync"] = sync["step_s"] / gen_s
        summary["async_eta2_tokens_over_sync"] = (
            by["async eta=2"]["response_tokens_per_s"] / sync["response_tokens_per_s"]
        )
    for suffix in ("", " 4 minibatches"):
        dec, naive = by.get(f"async eta=8 decoupled{suffix}"), by.get(f"async eta=8 naive{suffix}")
        if dec and naive:
            key = "decoupled_minus_naive_pass" + suffix.replace(" ", "_")
            summary[key] = dec["pass_after"] - naive["pass_after"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

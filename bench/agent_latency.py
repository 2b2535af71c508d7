"""Agent workloads: sync vs async samples/s with simulated tool latency, and the simulator's
prediction beside it (issue 20).

Every episode is ``--turns`` turns of the tiny model on the arithmetic task through the real
trainer (``relayrl.env.builtin.latency``: after each turn but the last the environment waits a
latency drawn from ``--latency``, default lognormal with median 0.05 s and p99 1 s capped at
4 s, i.e. the lecture's 0.1-30 s tool calls scaled to this machine's tiny model, then answers
``ok``). The same config runs ``schedule=sync`` (generate all episodes, then train) and
``schedule=async`` (eta = ``--eta``): while an episode waits, its engine slot serves others in
both, but only async trains while episodes wait. samples/s = episodes trained / the training
loop's seconds (``time/step`` summed: set-up and evaluation excluded).

The prediction: the model is profiled on this machine through relayrl's own engine
(``relayrl.rollout.timing.engine_profile``: engine decode steps, and a prefill with its fixed
cost per engine step, which every episode pays again each time it comes back from its
environment; ``--profile forward`` times bare forwards instead, which on this tiny model
undercounts a decode step and a resume: by how much, docs/environments.md), once before and
once after the two runs (averaged: the load of a shared machine drifts). The planner's
simulator then runs both schedules with the same batch, engine slots, turns, per-turn length
(the measured mean), observation tokens and latency distribution (sync on ``--sync-threads``
threads with independent agent loops, ``turn_barrier=False``; async's trainer and engine on
one thread each; KV evicted while waiting). Measured and predicted side by side, twice: over
the run's ``--steps`` from a cold start (``samples_per_s``: async's pipeline fill included),
and in steady state by the simulator's warm-up rule (the last ``steps - steps // 2`` steps;
the prediction over ``--sim-steps`` steps, as the heavy tail needs many to average).
Prints one JSON line.

    python bench/agent_latency.py                   # ~3-5 min on 2 cores
    python bench/agent_latency.py --steps 4 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from relayrl.cluster.local import build_local_roles
from relayrl.config import RunConfig, load_config
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model, load_tokenizer
from relayrl.plan.envlatency import parse_latency
from relayrl.plan.lengths import ConstantLengths
from relayrl.plan.profiling import profile
from relayrl.plan.simulator import SimConfig, simulate
from relayrl.plan.timemodel import THREAD_MEASUREMENTS, MeasuredProfile, ProfiledTimeModel
from relayrl.rollout.timing import engine_profile


def run(root: Path, model: Path, schedule: str, a: argparse.Namespace) -> dict:
    kwargs = json.dumps({"turns": a.turns, "latency": a.latency, "seed": a.seed})
    threads = (
        [f"threads={a.sync_threads}"] if schedule == "sync" else ["threads=1", f"async.eta={a.eta}"]
    )
    cfg: RunConfig = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={root / schedule}",
            f"seed={a.seed}",
            f"schedule={schedule}",
            *threads,
            "rollout.threads=1",
            f"rollout.max_slots={a.slots}",
            f"rollout.max_tokens={a.turn_tokens}",
            f"algo.prompts_per_step={a.prompts}",
            f"algo.group_size={a.group}",
            f"train.steps={a.steps}",
            "train.save_every=0",
            "data.eval_size=4",
            "env.factory=latency",
            f"env.kwargs={kwargs}",
            f"env.max_turns={a.turns}",
            f"env.step_timeout_s={a.timeout}",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    t0 = time.perf_counter()
    final = train(cfg, lambda x, c, cfg=cfg: build_local_roles(cfg, x, c))
    engine = final.get("engine") or {}
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (root / schedule / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "env/episodes" in r]
    loop_s = sum(r["time/step"] for r in steps)
    batch = a.prompts * a.group
    episodes = len(steps) * batch  # trained (async finishes more than it trains)
    h = len(steps) // 2  # the simulator's warm-up rule (plan.sim_report.steady_rate)
    return {
        "samples_per_s": episodes / loop_s,
        "steady_samples_per_s": (len(steps) - h) * batch / sum(r["time/step"] for r in steps[h:]),
        "loop_s": round(loop_s, 2),
        "wall_s": round(wall, 2),
        "episodes": episodes,
        "response_length_mean": sum(r["response_length_mean"] for r in steps) / len(steps),
        "failures": sum(r.get("env/failures", 0) for r in steps),
        # where a step's seconds went (means over steps): sync generates then trains;
        # async waits for finished groups, then trains while the engine goes on
        "step_s": [round(r["time/step"], 3) for r in steps],
        **{
            k.split("/")[1] + "_s_mean": round(sum(r.get(k, 0.0) for r in steps) / len(steps), 3)
            for k in ("time/generate", "time/train", "time/wait", "time/weight_sync")
        },
        "engine": {
            k: round(float(engine[k]), 3)
            for k in (
                "steps",
                "tokens_generated",
                "prefill_tokens",
                "decode_time_s",
                "prefill_time_s",
                "sample_time_s",
            )
            if k in engine
        },
        "gen_tokens_per_s_mean": round(
            sum(r.get("gen_tokens_per_s", 0.0) for r in steps) / len(steps), 1
        ),
    }


def predict(
    model: Path, a: argparse.Namespace, turn_len: float, obs_tokens: int, prof: MeasuredProfile
) -> dict:
    """The simulator's figures for both schedules on ``prof``: steady state over
    ``--sim-steps`` steps (the heavy tail needs many to average), and over the run's own
    ``--steps`` from a cold start (what ``samples_per_s`` measures)."""
    tm = ProfiledTimeModel(prof, concurrency=a.slots)
    common = dict(
        lengths=ConstantLengths(max(1, round(turn_len))),
        batch_size=a.prompts * a.group,
        prompt_len=8,
        slots_per_replica=a.slots,  # the engine's rollout.max_slots
        weight_sync_s=0.0,
        turns=a.turns,
        env_latency=parse_latency(a.latency),
        obs_tokens=obs_tokens,
        resume_prefill="context",
        seed=a.seed,
    )
    # sync: one process on --sync-threads threads; async: trainer and engine, one each
    sync_kw = dict(
        schedule="sync",
        n_devices=a.sync_threads,
        gen_devices_per_replica=a.sync_threads,
        turn_barrier=False,
    )
    async_kw = dict(
        schedule="async", n_devices=2, train_devices=1, gen_devices_per_replica=1, eta=a.eta
    )
    out: dict[str, float] = {}
    for name, kw in (("sync", sync_kw), ("async", async_kw)):
        steady = simulate(SimConfig(tm, n_steps=a.sim_steps, **kw, **common))
        short = simulate(SimConfig(tm, n_steps=a.steps, **kw, **common))
        out[f"{name}_steady_samples_per_s"] = steady.steady_samples_per_s
        out[f"{name}_samples_per_s"] = short.samples_per_s
        busy = steady.breakdown.get("generate_busy_s", steady.breakdown.get("generate_s", 0.0))
        out[f"{name}_generate_s_per_step"] = busy / a.sim_steps
        out[f"{name}_train_s_per_step"] = steady.breakdown["train_s"] / a.sim_steps
    out["steady_speedup"] = out["async_steady_samples_per_s"] / out["sync_steady_samples_per_s"]
    out["speedup"] = out["async_samples_per_s"] / out["sync_samples_per_s"]
    # what one run of --steps steps may show by chance (the latency draws): the speed-ups of
    # runs of that length under seeds 0..9, overall and by the warm-up rule
    overall, steady = [], []
    for seed in range(10):
        runs = [
            simulate(SimConfig(tm, n_steps=a.steps, **kw, **{**common, "seed": seed}))
            for kw in (sync_kw, async_kw)
        ]
        overall.append(runs[1].samples_per_s / runs[0].samples_per_s)
        steady.append(runs[1].steady_samples_per_s / runs[0].steady_samples_per_s)
    out["speedup_range_10_seeds"] = [min(overall), max(overall)]  # type: ignore[assignment]
    out["steady_speedup_range_10_seeds"] = [min(steady), max(steady)]  # type: ignore[assignment]
    return out


def measure(model: Path, a: argparse.Namespace) -> MeasuredProfile:
    """This machine's profile of the model (``--profile``): at ``--sync-threads`` threads,
    and at 1 thread (async's trainer and engine) when that differs."""
    if a.profile == "forward":
        return profile(model, batches=(1, 4, 16, 64), threads=a.sync_threads, also_threads=(1,))
    prof = engine_profile(model, threads=a.sync_threads)
    if a.sync_threads != 1:
        one = engine_profile(model, threads=1)
        keys = (*THREAD_MEASUREMENTS, "prefill_overhead_s")
        prof.at_threads[1] = {k: getattr(one, k) for k in keys}
    return prof


def mean_profile(x: MeasuredProfile, y: MeasuredProfile) -> MeasuredProfile:
    """Mean seconds of two profiles (rates: the rate of the mean time), per thread count."""

    def avg(m: dict, n: dict) -> dict:
        def mean(k: str) -> float:
            return (m.get(k, 0.0) + n.get(k, 0.0)) / 2

        def rate(k: str) -> float:  # the rate of the mean time per token
            return 2 / (1 / m[k] + 1 / n[k])

        steps = {b: (m["decode_step_s"][b] + n["decode_step_s"][b]) / 2 for b in m["decode_step_s"]}
        return {
            "decode_step_s": steps,
            "decode_s_per_ctx_token": mean("decode_s_per_ctx_token"),
            "prefill_tokens_per_s": rate("prefill_tokens_per_s"),
            "train_tokens_per_s": rate("train_tokens_per_s"),
            "prefill_overhead_s": mean("prefill_overhead_s"),
        }

    keys = (*THREAD_MEASUREMENTS, "prefill_overhead_s")
    base = avg({k: getattr(x, k) for k in keys}, {k: getattr(y, k) for k in keys})
    at = {t: avg(m, y.at_threads[t]) for t, m in x.at_threads.items() if t in y.at_threads}
    return replace(x, at_threads=at, **base)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--latency", default="lognormal:0.05:1.0:4")
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sim-steps", type=int, default=200, help="steps of the steady prediction")
    p.add_argument(
        "--profile",
        choices=("engine", "forward"),
        default="engine",
        help="time generation through relayrl's engine (relayrl.rollout.timing) or bare forwards",
    )
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--slots", type=int, default=64, help="rollout.max_slots (engine slots)")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-threads", type=int, default=1, help="2 on an idle 2-core machine")
    p.add_argument("--keep", default=None, help="keep the run directories here")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        root = Path(a.keep) if a.keep else Path(d)
        model = build_tiny_model(root / "m", hidden_size=64, seed=a.seed)
        tok = load_tokenizer(model)
        obs = len(tok("T:ok\nA:", add_special_tokens=False)["input_ids"])
        before = measure(model, a)
        sync = run(root, model, "sync", a)
        asyn = run(root, model, "async", a)
        prof = mean_profile(before, measure(model, a))
        if a.keep:
            prof.save(root / "profile.json")
        # an episode's response is its turns plus (turns - 1) observations: the model's
        # tokens per turn are what is left of it, shared by the turns
        turn_len = (sync["response_length_mean"] - obs * (a.turns - 1)) / a.turns
        pred = predict(model, a, turn_len, obs, prof)
    out = {
        "bench": "agent_latency",
        "latency": a.latency,
        "turns": a.turns,
        "batch": a.prompts * a.group,
        "steps": a.steps,
        "eta": a.eta,
        "sync": sync,
        "async": asyn,
        "measured_speedup": round(asyn["samples_per_s"] / sync["samples_per_s"], 3),
        "measured_steady_speedup": round(
            asyn["steady_samples_per_s"] / sync["steady_samples_per_s"], 3
        ),
        "profile": {
            "source": a.profile,
            "decode_step_s": prof.decode_step_s,
            "prefill_tokens_per_s": round(prof.prefill_tokens_per_s),
            "prefill_overhead_s": prof.prefill_overhead_s,
            "train_tokens_per_s": round(prof.train_tokens_per_s),
        },
        "predicted": {
            k: [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
            for k, v in pred.items()
        },
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])

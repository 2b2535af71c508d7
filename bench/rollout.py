"""Rollout engine throughput against its peers, on a tiny model with heavy-tailed lengths.

Prints ONE JSON line. Every rate is *useful* tokens per second: the tokens each request asked
for (its target length), not the padding a static batch keeps decoding after a short answer
ended. Target lengths are lognormal, capped; the model is random, so EOS is ignored and each
request runs exactly to its target (``max_tokens`` = target). All methods sample at
temperature 1 and run in the same process, one after the other, on the same prompts:

- ``engine``: ``RolloutEngine`` with ``--slots`` slots, every request submitted at once.
- ``static``: ``transformers`` ``generate`` on static batches of ``--slots`` requests (in
  submission order), each batch running until its longest target.
- ``ceiling``: the engine with all slots full and no tail: as many requests as the engine run
  (``--ceiling-requests``), every one of the mean target length, so the same useful tokens,
  and contexts shorter than in the heavy-tailed run. Measured just before and just after each
  engine run and averaged; ``engine_vs_ceiling`` is the median over ``--repeats k`` of each
  engine run over the ceiling runs around it (``engine_vs_ceiling_pairs``). Earlier versions
  ran a 96-request ceiling, far shorter than the engine run, and took the best of each: a
  short phase lands in a quiet spell more often, so that ratio leaned low (the spread of the
  ceiling's own runs is in docs/measurements.md); ``engine_vs_ceiling_best`` keeps that
  best-over-best figure.
- ``lockstep`` (``--lockstep-runs k``): the engine's heavy-tailed run (k times) and the
  ceiling's stepped in turn, one step each, every step timed alone (:func:`run_lockstep`):
  each engine step has a ceiling step beside it, milliseconds apart, so the machine's slow
  and fast spells cancel in the ratio instead of landing on one side of a pair of runs.
  ``forward_ratio``: the ceiling's forwards per run over the engine's, the share of the
  ceiling an engine reaches where every forward costs the same whatever its rows. A lockstep
  run's time is per-forward cost plus per-token work (``bench/rollout_fit.py`` fits its steps
  as ``a forwards + b generated tokens + c prompt tokens + d cached columns``), of which the
  heavy-tailed run does more (its tokens attend over more cached columns on average). On the
  default model both parts' ratios sit near each other (the fitted costs, the per-forward
  share and the ratios are in docs/measurements.md), so the figure sits near this one:
  per-forward or per-token speed-ups barely move it, cheaper attention per column lifts it a
  little, and only fewer forwards (the lengths: LPT) lift it much.
  ``per_run``: each engine run's rate over the ceiling's in the steps stepped beside it
  (the spread within one invocation), ``per_run_median`` their median.
- ``matched ceiling``: as ``ceiling``, but every request of the heavy-tailed run's mean length
  per generated token (``sum t^2 / sum t``): its tokens attend over as many cached columns on
  average as the engine run's do, with all slots full and no tail. Decode attention reads
  the cache once per token, so the plain ceiling's shorter contexts make it cheaper per token
  than any schedule of the heavy-tailed requests could be; ``engine_vs_matched_ceiling`` (a
  median of pairs like ``engine_vs_ceiling``) is what scheduling alone leaves on the table.
- ``steady``: the engine's own rate on the heavy-tailed run over the steps where every slot
  was busy (queue not empty): the all-slots-full rate of the same workload.
- ``oracle_lpt``: the engine on the same requests submitted longest first (LPT list
  scheduling), which needs every length in advance: here the bench's ``max_tokens`` are the
  targets, but an RL engine's requests all carry the same ``max_tokens``, so no engine can
  order them so. ``oracle_lpt_vs_ceiling`` (median of pairs, like ``engine_vs_ceiling``) is
  what the heavy-tailed run would reach with the lengths known (no tail; ``--skip-oracle``).
- ``steps``: the run's step counts from its lengths alone (:func:`step_bounds`): ideal (the
  ceiling's), FIFO (the engine's), LPT, and the mean over random orders, i.e. what an engine
  that does not know the lengths gets on average; ``oblivious_ratio`` = ideal / that mean is
  the share of the ceiling such an engine reaches where a step costs the same however many
  rows it holds (a small model's decode step on a GPU).
- ``*_step_kinds``: the engine run's and the (last) ceiling run's steps by kind, with their
  count, seconds, ms per step and mean rows: ``admit`` (requests admitted: their prefills
  ride next to the decode rows), ``decode`` (every slot busy, nothing admitted), ``tail``
  (the queue is empty and slots drain). The heavy-tailed run admits in most steps and ends
  in a tail of nearly-empty steps; the ceiling admits in waves and has no tail.
- ``vllm``: :class:`relayrl.rollout.vllm_backend.VllmEngine` (vLLM's ``LLMEngine`` in this
  process, ``max_num_seqs`` = ``--slots``) on the same requests, when ``import vllm`` works
  (``make vllm-venv``; ``--skip-vllm`` to skip). vLLM's CPU attention needs a head size of 32,
  64, ...: the default tiny model's is 16, so run ``--heads 2 --kv-heads 1`` for this row.
- weight-update latency (``*_weight_update_s``): median of 5 in-memory updates (no request in
  flight) for the engine and for vLLM (``collective_rpc("reload_weights")``).
- ``hf_cb``: ``transformers``' continuous batching manager (``generate_batch``'s engine) with
  per-request ``max_new_tokens`` and its paged cache sized like the engine's, on the same
  requests (``--cb-requests N``: the first N only; ``--skip-hf-cb`` to skip).

The peer runners (``static``, ``vllm``, ``hf_cb``) live in ``bench/rollout_peers.py``.

Peak memory is the process's peak RSS (``resource.getrusage``) after each phase (phases run
in the order engine, ceiling, static, hf_cb, so a later phase only shows if it raised it).

    .venv/bin/python bench/rollout.py [--requests 512 --slots 32 --arch llama]
    .vllm-venv/bin/python bench/rollout.py --heads 2 --kv-heads 1   # with the vLLM row
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from relayrl.model.loading import load_causal_lm  # noqa: E402
from relayrl.model.tiny import build_tiny_model  # noqa: E402
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # bench/ is not a package
from rollout_peers import EOS, PAD, run_hf_cb, run_static, run_vllm, update_latency  # noqa: E402

clock = time.perf_counter
"""What every rate is measured with: wall time, or with ``--clock cpu`` this process's CPU
time (``time.process_time``, all its threads): on a machine shared with other jobs a run's
wall time moves with their load (how far: docs/measurements.md), its CPU time far less."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def workload(n: int, median: float, sigma: float, cap: int, seed: int) -> tuple[list, list]:
    """Prompts (8..32 tokens) and lognormal target lengths in [1, cap]."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(8, 33, (n,), generator=g).tolist()
    prompts = [torch.randint(4, 80, (p,), generator=g).tolist() for p in plens]
    z = torch.randn(n, generator=g, dtype=torch.float64)
    targets = [max(1, min(cap, round(median * math.exp(sigma * float(x))))) for x in z]
    return prompts, targets


def pair_ratios_of(runs: list[float], around: list[float]) -> list[float]:
    """Each run over the mean of the two reference runs measured just before and after it
    (``around[i]``, ``around[i + 1]``)."""
    return [x / (0.5 * (around[i] + around[i + 1])) for i, x in enumerate(runs)]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return 0.5 * (s[len(s) // 2] + s[(len(s) - 1) // 2])


def makespan(lengths: list[int], slots: int) -> int:
    """Steps to run requests of these lengths, admitted in this order to the first free of
    ``slots`` slots (list scheduling; a request admitted in a step makes its first token there)."""
    free_at = [0] * slots
    for n in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return max(free_at)


def step_bounds(targets: list[int], slots: int, shuffles: int = 500, seed: int = 0) -> dict:
    """Steps of the heavy-tailed run: ``ideal`` (every step full: ceil(sum / slots), the
    ceiling's count), ``fifo`` (submission order, what the engine runs), ``lpt`` (longest first:
    needs the lengths), ``oblivious_mean`` (mean over random orders: what any order chosen
    without the lengths gets on average; in RL every request has the same ``max_tokens``).
    ``oblivious_ratio`` = ideal / oblivious_mean: the share of the ceiling an engine that does
    not know the lengths reaches on average where a step costs the same however many rows it
    holds (a small model's decode step on a GPU)."""
    rng = random.Random(seed)
    spans = [makespan(rng.sample(targets, len(targets)), slots) for _ in range(shuffles)]
    ideal = -(-sum(targets) // slots)
    mean = sum(spans) / len(spans)
    return {
        "ideal": ideal,
        "fifo": makespan(targets, slots),
        "lpt": makespan(sorted(targets, reverse=True), slots),
        "oblivious_mean": round(mean, 1),
        "oblivious_p5_p95": [sorted(spans)[len(spans) // 20], sorted(spans)[-len(spans) // 20]],
        "oblivious_ratio": round(ideal / mean, 3),
    }


def engine_with(model, prompts, targets, slots: int, max_len: int) -> RolloutEngine:
    """A fresh engine with every request submitted (request i runs exactly ``targets[i]``
    tokens, seed i)."""
    engine = RolloutEngine(
        model, eos_token_id=EOS, pad_token_id=PAD, max_slots=slots, max_model_len=max_len
    )
    for i, (p, t) in enumerate(zip(prompts, targets, strict=True)):
        engine.submit(GenerationRequest(p, SamplingParams(max_tokens=t, ignore_eos=True, seed=i)))
    return engine


def run_engine(model, prompts, targets, slots: int, max_len: int) -> tuple[float, float, dict]:
    """Returns (useful tokens/s overall, tokens/s over the steps that ran with every slot
    busy, stats)."""
    t0 = clock()
    engine = engine_with(model, prompts, targets, slots, max_len)
    got = 0
    full_tokens, full_time = 0, 0.0
    sched = engine.scheduler
    kinds: dict[str, list[float]] = {}  # kind -> [steps, seconds, rows]
    step_rows: list[int] = []
    while engine.has_unfinished():
        free = slots - len(sched.running)
        full = len(sched.waiting) >= free  # every slot busy this step
        rows = len(sched.running) + min(len(sched.waiting), free)
        step_rows.append(rows)
        kind = "admit" if sched.waiting and free else ("decode" if full else "tail")
        before = engine.stats()["tokens_generated"] if full else 0
        ts = clock()
        got += sum(len(s.response_ids) for s in engine.step())
        step_s = clock() - ts
        k = kinds.setdefault(kind, [0, 0.0, 0])
        k[0], k[1], k[2] = k[0] + 1, k[1] + step_s, k[2] + rows
        if full:
            full_time += step_s
            full_tokens += engine.stats()["tokens_generated"] - before
    dt = clock() - t0
    assert got == sum(targets), (got, sum(targets))
    steady = full_tokens / full_time if full_time > 0 else float("nan")
    stats = engine.stats()
    stats["step_rows"] = step_rows  # rows of every step, in order
    stats["step_kinds"] = {
        kind: {
            "steps": n,
            "s": round(t, 4),
            "ms_per_step": round(1e3 * t / n, 3),
            "rows": round(r / n, 1),
        }
        for kind, (n, t, r) in sorted(kinds.items())
    }
    return got / dt, steady, stats


def run_lockstep(model, workloads, runs: int, slots: int, max_len: int) -> list[dict]:
    """Engines stepped in turn, one step each (the order alternating every round), each step
    timed alone: the machine's slow and fast spells (steal time, docs/measurements.md) fall
    on every workload alike, where back-to-back runs second apart catch different spells.
    ``workloads[0]`` runs ``runs`` times back to back; the others start again whenever they
    finish, so every one of the lead's steps has partners; a workload's rate counts its
    completed runs only (useful tokens over the seconds of their steps).
    Returns per workload ``{"tok_s", "runs", "steps", "forwards_per_run"}`` (the runner's
    forwards in a completed run: a step with more prompt tokens than a prefill chunk takes
    more than one); the lead's also ``"per_run"``: each of its runs' rate over the second
    workload's rate in the steps stepped beside that run (its tokens generated there over
    their seconds), the spread of the ratio within one invocation."""
    state = [
        {
            "prompts": p,
            "targets": t,
            "done": 0,
            "s": 0.0,
            "run_s": 0.0,
            "steps": 0,
            "fwd": 0,
            "win_s": 0.0,  # seconds and tokens since the lead's current run began
            "win_tok": 0,
        }
        for p, t in workloads
    ]
    per_run: list[float] = []

    def start(w: dict) -> None:
        w["engine"] = engine_with(model, w["prompts"], w["targets"], slots, max_len)
        w["run_s"] = 0.0

    for w in state:
        start(w)
    lead = state[0]
    rnd = 0
    while lead["done"] < runs:
        order = state if rnd % 2 == 0 else state[::-1]
        rnd += 1
        for w in order:
            if w is not lead and lead["done"] >= runs:
                continue
            before = w["engine"].stats()["tokens_generated"]
            ts = clock()
            w["engine"].step()
            dt = clock() - ts
            w["run_s"] += dt
            w["win_s"] += dt
            w["win_tok"] += w["engine"].stats()["tokens_generated"] - before
            w["steps"] += 1
            if not w["engine"].has_unfinished():
                w["done"] += 1
                w["s"] += w["run_s"]
                w["fwd"] += w["engine"].runner.num_forwards
                if w is lead and len(state) > 1 and state[1]["win_s"] > 0:
                    other = state[1]["win_tok"] / state[1]["win_s"]
                    per_run.append(sum(w["targets"]) / w["run_s"] / other)
                    for x in state:
                        x["win_s"], x["win_tok"] = 0.0, 0
                if w is not lead or w["done"] < runs:
                    start(w)
    out = [
        {
            "tok_s": w["done"] * sum(w["targets"]) / w["s"] if w["s"] else float("nan"),
            "runs": w["done"],
            "steps": w["steps"],
            "forwards_per_run": w["fwd"] / w["done"] if w["done"] else float("nan"),
        }
        for w in state
    ]
    out[0]["per_run"] = per_run
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2", "gpt2"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--median", type=float, default=24.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-hf-cb", action="store_true")
    ap.add_argument("--skip-oracle", action="store_true", help="no longest-first oracle run")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument(
        "--repeats", type=int, default=1, help="engine + ceiling runs; >1: best of each"
    )
    ap.add_argument(
        "--lockstep-runs",
        type=int,
        default=2,
        help="engine runs stepped in turn with ceiling runs (run_lockstep); 0 = skip",
    )
    ap.add_argument("--cb-requests", type=int, default=0, help="0 = all requests")
    ap.add_argument(
        "--ceiling-requests", type=int, default=0, help="uniform-length requests; 0 = --requests"
    )
    args = ap.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    max_len = 32 + args.cap + 1
    tmp = tempfile.TemporaryDirectory()
    path = build_tiny_model(
        Path(tmp.name) / "m",
        arch=args.arch,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_position_embeddings=max_len,
    )
    model = load_causal_lm(path).eval()
    prompts, targets = workload(args.requests, args.median, args.sigma, args.cap, args.seed)
    # Warm-up (allocators, lazy init) outside the timings.
    run_engine(model, prompts[:8], [4] * 8, args.slots, max_len)
    run_static(model, prompts[:8], [4] * 8, args.slots, clock)

    mean_len = max(1, round(sum(targets) / len(targets)))
    n_ceiling = args.ceiling_requests or len(prompts)

    # The matched ceiling: uniform requests whose length is the heavy-tailed run's mean
    # length per generated token (sum t^2 / sum t), so each token attends over as many
    # columns on average as in the engine run, and as many useful tokens in all.
    matched_len = max(1, round(sum(t * t for t in targets) / sum(targets)))
    n_matched = max(args.slots, round(sum(targets) / matched_len))
    matched_prompts = [prompts[i % len(prompts)] for i in range(n_matched)]
    matched_runs: list[float] = []

    def ceiling() -> tuple[float, dict]:
        tps, _, stats = run_engine(
            model, prompts[:n_ceiling], [mean_len] * n_ceiling, args.slots, max_len
        )
        matched_runs.append(
            run_engine(model, matched_prompts, [matched_len] * n_matched, args.slots, max_len)[0]
        )
        return tps, stats

    # The ceiling is measured just before and just after each engine run: on a shared
    # machine a single phase can land in a quiet or a busy spell; the ratio of an engine run
    # to the ceiling runs around it cancels slow drifts, and the median over --repeats k
    # pairs the spikes. The best-of-k rates are reported beside it.
    # The oracle: the same requests submitted longest first (LPT), which needs the lengths
    # (the bench's max_tokens are the targets; an RL engine's are all equal): what scheduling
    # with the lengths known would reach, run right after each engine run.
    order = sorted(range(len(targets)), key=lambda i: -targets[i])
    lpt_prompts, lpt_targets = [prompts[i] for i in order], [targets[i] for i in order]
    oracle_runs: list[float] = []

    def oracle() -> None:
        if not args.skip_oracle:
            oracle_runs.append(run_engine(model, lpt_prompts, lpt_targets, args.slots, max_len)[0])

    ceiling_before, _ = ceiling()
    engine_tps, steady_tps, st = run_engine(model, prompts, targets, args.slots, max_len)
    rss_engine = peak_rss_mb()
    oracle()
    ceiling_after, st_ceiling = ceiling()
    ceiling_tps = 0.5 * (ceiling_before + ceiling_after)
    engine_runs, ceiling_runs = [engine_tps], [ceiling_before, ceiling_after]
    for _ in range(args.repeats - 1):
        tps, steady, _ = run_engine(model, prompts, targets, args.slots, max_len)
        engine_runs.append(tps)
        steady_tps = max(steady_tps, steady)
        oracle()
        ceiling_runs.append(ceiling()[0])
    pair_ratios = pair_ratios_of(engine_runs, ceiling_runs)
    vs_ceiling = median(pair_ratios)
    vs_ceiling_best = max(engine_runs) / max(ceiling_runs)
    vs_matched = median(pair_ratios_of(engine_runs, matched_runs))
    vs_oracle_ceiling = median(pair_ratios_of(oracle_runs, ceiling_runs)) if oracle_runs else None
    if args.repeats > 1:
        engine_tps, ceiling_tps = max(engine_runs), max(ceiling_runs)
    lockstep = None
    if args.lockstep_runs:
        eng_ls, ceil_ls = run_lockstep(
            model,
            [(prompts, targets), (prompts[:n_ceiling], [mean_len] * n_ceiling)],
            args.lockstep_runs,
            args.slots,
            max_len,
        )
        lockstep = {
            "engine_tok_s": round(eng_ls["tok_s"], 3),
            "ceiling_tok_s": round(ceil_ls["tok_s"], 3),
            "engine_vs_ceiling": round(eng_ls["tok_s"] / ceil_ls["tok_s"], 3),
            "runs": [eng_ls["runs"], ceil_ls["runs"]],
            "forwards_per_run": [eng_ls["forwards_per_run"], ceil_ls["forwards_per_run"]],
            "forward_ratio": round(ceil_ls["forwards_per_run"] / eng_ls["forwards_per_run"], 3),
            "per_run": [round(x, 3) for x in eng_ls["per_run"]],
            "per_run_median": round(median(eng_ls["per_run"]), 3),
        }
    rss_ceiling = peak_rss_mb()
    static_tps, static_util = run_static(model, prompts, targets, args.slots, clock)
    rss_static = peak_rss_mb()
    hf_cb: float | str = "skipped"
    n_cb = min(args.cb_requests or len(prompts), len(prompts))
    engine_sub_tps = engine_tps
    if not args.skip_hf_cb:
        hf_cb = run_hf_cb(model, prompts[:n_cb], targets[:n_cb], args.slots, clock)
        if n_cb < len(prompts):
            sub = run_engine(model, prompts[:n_cb], targets[:n_cb], args.slots, max_len)
            engine_sub_tps = sub[0]
    rss_cb = peak_rss_mb()
    own = RolloutEngine(
        model, eos_token_id=EOS, pad_token_id=PAD, max_slots=args.slots, max_model_len=max_len
    )
    own_update_s = update_latency(
        lambda sd, v: own.update_weights(sd, v, interrupt=True), model.state_dict(), 0
    )
    vllm = {"vllm": "skipped (--skip-vllm)"}
    if not args.skip_vllm:
        vllm = run_vllm(path, model, prompts, targets, args.slots, max_len, clock)
    tmp.cleanup()
    r = lambda x: round(x, 3)  # noqa: E731
    out = {
        "bench": "rollout",
        "arch": args.arch,
        "requests": args.requests,
        "slots": args.slots,
        "target_len": {
            "median": args.median,
            "sigma": args.sigma,
            "cap": args.cap,
            "mean": r(sum(targets) / len(targets)),
            "max": max(targets),
        },
        "useful_tokens": sum(targets),
        "engine_tok_s": r(engine_tps),
        "static_tok_s": r(static_tps),
        "ceiling_tok_s": r(ceiling_tps),
        "ceiling_tok_s_before_after": [r(ceiling_before), r(ceiling_after)],
        "engine_tok_s_runs": [r(x) for x in engine_runs],
        "ceiling_tok_s_runs": [r(x) for x in ceiling_runs],
        "hf_cb_tok_s": r(hf_cb) if isinstance(hf_cb, float) else hf_cb,
        "engine_vs_static": r(engine_tps / static_tps),
        "engine_vs_ceiling": r(vs_ceiling),
        "engine_vs_ceiling_pairs": [r(x) for x in pair_ratios],
        "engine_vs_ceiling_best": r(vs_ceiling_best),
        "lockstep": lockstep,
        "ceiling_requests": n_ceiling,
        "matched_ceiling": {"len": matched_len, "requests": n_matched},
        "matched_ceiling_tok_s_runs": [r(x) for x in matched_runs],
        "engine_vs_matched_ceiling": r(vs_matched),
        "oracle_lpt_tok_s_runs": [r(x) for x in oracle_runs],
        "oracle_lpt_vs_ceiling": r(vs_oracle_ceiling) if vs_oracle_ceiling else None,
        "steps": step_bounds(targets, args.slots),
        "engine_steady_tok_s": r(steady_tps),
        "engine_vs_steady": r(engine_tps / steady_tps),
        "hf_cb_requests": n_cb,
        "engine_tok_s_on_hf_cb_requests": r(engine_sub_tps),
        "engine_vs_hf_cb": r(engine_sub_tps / hf_cb) if isinstance(hf_cb, float) else None,
        "engine_weight_update_s": round(own_update_s, 5),
        **{k: round(v, 5) if isinstance(v, float) else v for k, v in vllm.items()},
        "engine_vs_vllm": r(engine_tps / vllm["vllm_tok_s"]) if "vllm_tok_s" in vllm else None,
        "engine_slot_utilisation": r(st["mean_slot_utilisation"]),
        "ceiling_slot_utilisation": r(st_ceiling["mean_slot_utilisation"]),
        "static_useful_fraction": r(static_util),
        "engine_steps": st["steps"],
        # where the run's time went: steps that admit requests (prefills next to decode rows),
        # all-slots-busy decode steps, and the tail (queue empty, slots draining)
        "engine_step_kinds": st["step_kinds"],
        "ceiling_step_kinds": st_ceiling["step_kinds"],
        "engine_kv_cache_mb": r(st["kv_cache_bytes"] / 2**20),
        "peak_rss_mb": {
            "after_engine": r(rss_engine),
            "after_ceiling": r(rss_ceiling),
            "after_static": r(rss_static),
            "after_hf_cb": r(rss_cb),
        },
        "threads": args.threads,
        "clock": args.clock,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Planner subcommands: ``simulate``, ``reshard``, ``placement``, ``plan``, ``cost``, ``profile``.

``add_subcommands(subparsers)`` registers them on an argparse subparsers object; each sets
``fn=handler`` where ``handler(args) -> int`` prints a rich table (or JSON with ``--json``).
Bad input raises ``ValueError`` with a one-line message (the main CLI maps it to exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_subcommands", "main"]


# -- parsing helpers --------------------------------------------------------------------------
def _layout(text: str, n: int, what: str) -> tuple[int, ...]:
    parts = text.replace("x", "-").split("-")
    try:
        vals = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what} must look like {'-'.join(['N'] * n)}, got {text!r}") from None
    if len(vals) != n or min(vals) < 1:
        raise ValueError(f"{what} must be {n} positive integers joined by '-', got {text!r}")
    return vals


def _eta(text: str) -> int | None:
    if text.lower() in ("inf", "none", "unbounded"):
        return None
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"eta must be an integer >= 0 or 'inf', got {text!r}") from None
    if v < 0:
        raise ValueError(f"eta must be >= 0, got {v}")
    return v


def _turns(text: str) -> Any:
    """``N`` (every episode N turns) or a length spec for a distribution of turn counts."""
    from relayrl.plan.lengths import parse_lengths

    if text.strip().isdigit():
        v = int(text)
        if v < 1:
            raise ValueError(f"--turns must be >= 1, got {v}")
        return v
    return parse_lengths(text)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _print_table(title: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    for c in cols:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[_fmt(r.get(c, "")) for c in cols])
    Console().print(table)  # the terminal's width (COLUMNS when not a terminal); cells fold


def _fmt(v: Any) -> str:
    """Numbers for people: ``41,850`` (>= 1000, thousands separated), ``15.24`` (4
    significant digits), ``0.0004``; never an exponent below 1e15."""
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 1e-3:
            return f"{v:.3g}"
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10000:
        return f"{v:,}"
    return str(v)


def _positive(name: str, v: float | None) -> None:
    if v is not None and not v > 0:
        raise ValueError(f"{name} must be > 0, got {v:g}")


def _time_model(args: argparse.Namespace) -> Any:
    from relayrl.plan.hardware import get_hardware
    from relayrl.plan.models import get_model
    from relayrl.plan.timemodel import MeasuredProfile, ProfiledTimeModel, RooflineTimeModel

    if getattr(args, "profile", None):
        return ProfiledTimeModel(MeasuredProfile.load(args.profile), concurrency=args.slots or 32)
    from relayrl.plan.hardware import MEASURED

    measured = MEASURED.get(args.hardware.strip().lower())
    return RooflineTimeModel(
        get_model(args.model),
        get_hardware(args.hardware),
        decode_efficiency=args.decode_eff,
        mfu=args.mfu,
        step_overhead_s=measured.decode_step_overhead_s if measured else 0.0,
    )


# -- simulate ----------------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from relayrl.plan.envlatency import parse_latency
    from relayrl.plan.lengths import parse_lengths
    from relayrl.plan.plots import plot_simulations, write_chrome_trace
    from relayrl.plan.simulator import SimConfig, simulate, sparkline
    from relayrl.plan.timemodel import DoesNotFit

    if args.slots is not None and args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    tm = _time_model(args)
    lengths = parse_lengths(args.lengths)
    schedules = _csv(args.schedule)
    etas = [_eta(e) for e in _csv(args.eta)]
    try:
        splits: list[int | None] = (
            [int(x) for x in _csv(args.train_devices)] if args.train_devices else [None]
        )
    except ValueError:
        raise ValueError(f"--train-devices must be integers, got {args.train_devices!r}") from None
    runs: list[tuple[str, Any]] = []
    refused: list[dict[str, Any]] = []
    combos: list[tuple[str, int | None, int | None]] = []
    for sched in schedules:
        if sched not in ("sync", "overlap", "async"):
            raise ValueError(f"schedule must be sync, overlap or async, got {sched!r}")
        for eta in etas if sched == "async" else [None]:
            for split in splits if sched != "sync" else [None]:
                combos.append((sched, eta, split))
    for sched, eta, split in combos:
        cfg = SimConfig(
            time_model=tm,
            lengths=lengths,
            schedule=sched,  # type: ignore[arg-type]
            n_devices=args.devices,
            train_devices=split,
            gen_devices_per_replica=args.tp,
            batch_size=args.batch,
            n_steps=args.steps,
            prompt_len=args.prompt_len,
            eta=eta,
            interrupt=not args.no_interrupt,
            in_order=not args.finish_order,
            slots_per_replica=args.slots,
            weight_sync_s=args.weight_sync_s,
            sync_bandwidth=args.sync_bandwidth * 1e9,
            seed=args.seed,
            record_events=bool(args.plot),
            turns=_turns(args.turns),
            env_latency=parse_latency(args.env_latency) if args.env_latency else None,
            obs_tokens=args.obs_tokens,
            resume_prefill=args.resume_prefill,
            turn_barrier=not args.independent_turns,
        )
        label = sched if sched != "async" else f"async eta={'inf' if eta is None else eta}"
        if split is not None and len(splits) > 1:
            label += f" train={split}"
        try:
            runs.append((label, simulate(cfg)))
        except DoesNotFit as exc:
            if len(combos) == 1:
                raise
            refused.append({"config": label, "refused": str(exc)})
    if not runs:
        raise ValueError(refused[0]["refused"])
    base = next((r for lbl, r in runs if lbl == "sync"), runs[0][1])
    rows = []
    multi_turn = any("episode_env_wait_s" in r.breakdown for _, r in runs)
    for label, r in runs:
        s = r.summary()
        sp = r.steady_samples_per_s / base.steady_samples_per_s
        if args.json:
            row = {"config": label, **s, "speedup": sp}
        else:
            b = r.breakdown
            row = {
                "config": label,
                "samples/s": s["steady_samples_per_s"],
                "speedup": round(sp, 3),
                "tokens/s": r.tokens_per_s,
                "gen util": s["slot_utilisation"],
                "<10% running": s["low_utilisation_share"],
                "stale mean/max": f"{s['mean_staleness']:.2f}/{s['max_staleness']}",
                "generate s": b.get("generate_s", b.get("generate_busy_s", 0.0)),
                "train s": b["train_s"],
                "trainer idle s": b.get("trainer_idle_s", 0.0),
                "reprefill s": b.get("reprefill_s", 0.0),
            }
            if multi_turn:
                row["env wait s/episode"] = b.get("episode_env_wait_s", 0.0)
        rows.append(row)
    rows += refused
    _print_table("relayrl simulate", rows, args.json)
    for label, r in runs:
        for w in r.warnings:
            print(f"relayrl simulate: warning: {label}: {w}", file=sys.stderr)
    if not args.json:
        for label, r in runs:
            print(f"{label:>16} |{sparkline([u for _, u in r.utilisation_timeline])}|")
    if args.plot:
        out = Path(args.plot)
        paths = plot_simulations(runs, out)
        for label, r in runs:
            safe = label.replace(" ", "_").replace("=", "")
            paths.append(write_chrome_trace(r.events, out / f"trace_{safe}.json"))
        if not args.json:
            print("wrote " + ", ".join(str(p) for p in paths))
    return 0


# -- reshard -----------------------------------------------------------------------------------
def cmd_reshard(args: argparse.Namespace) -> int:
    from relayrl.plan.models import get_model
    from relayrl.plan.reshard import STRATEGIES, reshard

    train = _layout(args.train, 3, "--train")
    gen = _layout(args.gen, 2, "--gen")
    _positive("--model-gb", args.model_gb)
    _positive("--bandwidth (GB/s)", args.bandwidth)
    if args.model_gb is not None:
        mbytes: float | None = args.model_gb * 1e9
    elif args.model:
        mbytes = get_model(args.model).weight_bytes
    else:
        mbytes = None
    strategies = _csv(args.strategy) if args.strategy != "all" else list(STRATEGIES)
    bw = args.bandwidth * 1e9 if args.bandwidth is not None else None
    rows = []
    plans = []
    for s in strategies:
        plan = reshard(train, gen, s, mbytes, bw)  # type: ignore[arg-type]
        plans.append(plan)
        rows.append(plan.summary())
    _print_table(f"reshard {args.train} -> {args.gen}", rows, args.json)
    if args.per_gpu:
        for plan in plans:
            _print_table(
                f"{plan.strategy}: per GPU (fractions of the model)",
                [g.to_dict(mbytes) for g in plan.gpus],
                args.json,
            )
    return 0


# -- placement ---------------------------------------------------------------------------------
def _four_models(args: argparse.Namespace) -> dict[str, Any]:
    from relayrl.plan.models import get_model

    return {
        r: get_model(getattr(args, r) or args.model) for r in ("actor", "critic", "ref", "reward")
    }


def cmd_placement(args: argparse.Namespace) -> int:
    import numpy as np

    from relayrl.plan.hardware import get_hardware
    from relayrl.plan.lengths import parse_lengths
    from relayrl.plan.placement import RLHFWorkload, placement_memory, search_placements

    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    models = _four_models(args)
    lengths = parse_lengths(args.lengths) if args.lengths else None
    mean_len = args.mean_len
    if lengths is not None:  # the FLOP terms use the distribution's mean
        mean_len = int(round(float(np.mean(lengths.sample(8192, np.random.default_rng(0))))))
        lengths = parse_lengths(args.lengths)  # fresh (fixed lengths keep a position)
    w = RLHFWorkload(
        models,
        get_hardware(args.hardware),
        batch=args.batch,
        prompt_len=args.prompt_len,
        mean_len=mean_len,
        max_len=args.max_len,
        gen_per_device=args.gen_per_device,
        mfu=args.mfu,
        decode_efficiency=args.decode_eff,
        lengths=lengths,
    )
    for n in [int(x) for x in _csv(args.devices)]:
        res = search_placements(w, n)
        rows = []
        for rank, r in enumerate(res[: args.top], 1):
            d = r.to_dict()
            d["memory_gb"] = [round(b / 1e9, 1) for b in placement_memory(r.placement, models)]
            rows.append({"rank": rank, **d})
        _print_table(f"placements on {n} x {args.hardware}", rows, args.json)
    return 0


# -- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from relayrl.plan.hardware import get_hardware
    from relayrl.plan.search import (
        PPOProblem,
        asymmetric_plan,
        heuristic_plan,
        search_plan,
        symmetric_plan,
    )

    pb = PPOProblem(
        _four_models(args),
        get_hardware(args.hardware),
        n_nodes=args.nodes,
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
    )
    rows: list[dict[str, Any]] = []
    for name, fn in (
        ("heuristic", heuristic_plan),
        ("symmetric", symmetric_plan),
        ("asymmetric", asymmetric_plan),
    ):
        try:
            ev = pb.evaluate(fn(pb))
        except ValueError as exc:
            rows.append({"plan": name, "refused": str(exc)})
            continue
        rows.append({"plan": name, **{k: v for k, v in ev.to_dict().items() if k != "calls"}})
    best = search_plan(pb, steps=args.steps, seed=args.seed)
    rows.append({"plan": "search", **{k: v for k, v in best.to_dict().items() if k != "calls"}})
    heur = next((r["iteration_s"] for r in rows if "iteration_s" in r), None)
    for r in rows:
        if heur is not None and "iteration_s" in r:
            r["vs heuristic"] = round(heur / r["iteration_s"], 3)
    _print_table(f"execution plans on {args.nodes} x {pb.gpn} {args.hardware}", rows, args.json)
    calls = [{"call": c, **v} for c, v in best.to_dict()["calls"].items()]
    _print_table("searched plan", calls, args.json)
    if args.trace:
        from relayrl.plan.plots import write_chrome_trace

        write_chrome_trace(best.spans, args.trace, lane_key="mesh")
    return 0


# -- cost --------------------------------------------------------------------------------------
def cmd_cost(args: argparse.Namespace) -> int:
    from relayrl.plan.cost import model_set_memory_bytes, money, rl_step_cost, training_gpu_hours
    from relayrl.plan.hardware import get_hardware
    from relayrl.plan.models import get_model

    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    _positive("--price (per GPU-hour)", args.price)
    hw = get_hardware(args.hardware)
    m = get_model(args.model)
    price = hw.price_per_hour if args.price is None else args.price
    rows: list[dict[str, Any]] = []
    if args.tokens:
        h = training_gpu_hours(m, args.tokens, hw, args.mfu)
        rows.append(
            {
                "item": f"train {m.name} on {args.tokens:.3g} tokens",
                "gpu_hours": round(h, 3),
                "cost": round(money(h, price), 2),
                "days_on": f"{h / 24 / args.gpus:.3g} d on {args.gpus} GPUs",
            }
        )
    mem = model_set_memory_bytes(
        [(m.params, True), (m.params, True), (m.params, False), (m.params, False)]
    )
    rows.append(
        {
            "item": f"memory actor+critic (trained) + ref+reward (frozen), {m.name}",
            "gb": round(mem / 1e9, 1),
        }
    )
    _print_table(f"cost on {hw.name} at {price}/GPU-hour", rows, args.json)
    if args.rl:
        c = rl_step_cost(
            m,
            hw,
            prompts=args.prompts,
            samples_per_prompt=args.samples,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            mfu=args.mfu,
            ref=m if not args.no_ref else None,
            reward=get_model(args.reward_model) if args.reward_model else None,
            critic=m if args.critic else None,
            tail_factor=args.tail_factor,
            price_per_gpu_hour=price,
        )
        d = c.to_dict()
        rows = [
            {"component": k, "gpu_s": round(v, 2), "share": round(c.share(k), 4)}
            for k, v in c.components.items()
        ]
        rows.append(
            {
                "component": "total",
                "gpu_s": round(c.total_gpu_s, 2),
                "share": 1.0,
                "gpu_hours": d["gpu_hours"],
                "cost": d["cost"],
                "x_steps": f"{args.rl_steps} steps: {c.gpu_hours * args.rl_steps:.4g} GPU-h, "
                f"{c.cost * args.rl_steps:.4g}",
            }
        )
        _print_table("one RL step", rows, args.json)
    return 0


# -- profile -----------------------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    from relayrl.plan.profiling import profile

    batches = tuple(int(b) for b in _csv(args.batches))
    pr = profile(
        args.model_dir,
        batches=batches,
        context=args.context,
        decode_steps=args.decode_steps,
        threads=args.threads,
        also_threads=tuple(int(t) for t in _csv(args.also_threads)) if args.also_threads else (),
    )
    pr.save(args.out)
    rows = [
        {"batch": b, "decode_step_ms": round(t * 1e3, 4), "decode_tok/s": round(b / t, 1)}
        for b, t in pr.decode_step_s.items()
    ]
    _print_table(
        f"profile of {args.model_dir} ({pr.params:.3g} params, {pr.threads} threads)",
        rows,
        args.json,
    )
    _print_table(
        "throughput",
        [
            {
                "prefill_tok/s": round(pr.prefill_tokens_per_s, 1),
                "train_tok/s": round(pr.train_tokens_per_s, 1),
                "s/step/ctx token": pr.decode_s_per_ctx_token,
                "written": args.out,
            }
        ],
        args.json,
    )
    if pr.at_threads:
        _print_table(
            "at other thread counts",
            [
                {
                    "threads": t,
                    **{f"decode_ms@{b}": round(s * 1e3, 4) for b, s in m["decode_step_s"].items()},
                    "prefill_tok/s": round(m["prefill_tokens_per_s"], 1),
                    "train_tok/s": round(m["train_tokens_per_s"], 1),
                }
                for t, m in sorted(pr.at_threads.items())
            ],
            args.json,
        )
    return 0


# -- registration ------------------------------------------------------------------------------
def add_subcommands(sub: Any) -> None:
    """Register the planner subcommands (options in :mod:`relayrl.plan.cli_args`) on an
    argparse ``subparsers`` object."""
    from relayrl.plan.cli_args import register

    handlers = {
        "simulate": cmd_simulate,
        "reshard": cmd_reshard,
        "placement": cmd_placement,
        "plan": cmd_plan,
        "cost": cmd_cost,
        "profile": cmd_profile,
    }
    for name, parser in register(sub).items():
        parser.set_defaults(fn=_with_efficiencies(handlers[name]))


def _with_efficiencies(fn: Any) -> Any:
    """``fn`` with ``--mfu`` / ``--decode-eff`` filled in when not given: 0.4 (a
    ``*-measured`` hardware: its measured MFU, ``plan.hardware.MEASURED``) and 0.6."""

    def run(args: argparse.Namespace) -> Any:
        from relayrl.plan.hardware import MEASURED

        measured = MEASURED.get(str(getattr(args, "hardware", "")).strip().lower())
        if hasattr(args, "mfu") and args.mfu is None:
            args.mfu = measured.mfu if measured else 0.4
        if hasattr(args, "decode_eff") and args.decode_eff is None:
            args.decode_eff = 0.6
        return fn(args)

    return run


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m relayrl.plan.cli simulate ...``."""
    import sys

    parser = argparse.ArgumentParser(prog="relayrl-plan")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except ValueError as exc:
        print(f"relayrl {args.command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

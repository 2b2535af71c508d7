"""Calibration: the simulator's predicted async-over-sync speedup vs a measured one.

Inputs:

* ``--profile``: a profile of the model on this machine (``relayrl profile MODEL_DIR``).
* ``--schedules``: the JSON-lines output of ``bench/schedules.py``: one object per
  configuration with at least ``schedule`` (``sync`` | ``overlap`` | ``async``),
  ``samples_per_s`` and, for async, ``eta`` (``null`` = unbounded) and ``interrupt``. The
  benchmark's set-up is read from a ``config`` object (in any line, or a line of its own)
  with keys ``batch_size`` (samples per step), ``n_steps``, ``prompt_len``, ``lengths``
  (``lognormal:MEDIAN:SIGMA:CAP`` etc.), ``slots`` (engine slots), ``threads`` (total),
  ``train_threads`` (async trainer's share); command-line flags override it. Lines that are
  not JSON objects (a printed table) are skipped.

For every measured async (and overlap) configuration the script simulates the same
configuration and sync with the profiled time model and prints, as a table and as one JSON
line, the measured speedup ``samples_per_s(config) / samples_per_s(sync)``, the predicted one
and the relative error ``|pred - meas| / meas`` (goal: within 25%). ``--check`` makes the exit
code 1 when any error exceeds ``--tolerance``.

    .venv/bin/python bench/plan_calibration.py --profile profile.json --schedules sched.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from relayrl.plan.lengths import parse_lengths
from relayrl.plan.simulator import SimConfig, simulate
from relayrl.plan.timemodel import MeasuredProfile, ProfiledTimeModel

DEFAULTS: dict[str, Any] = {
    "batch_size": 32,
    "n_steps": 8,
    "prompt_len": 16,
    "lengths": "lognormal:32:0.8:256",
    "slots": 32,
    "threads": None,
    "train_threads": None,
}


def load_schedules(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measured rows and the benchmark config found in a JSON-lines file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"schedules file not found: {p}")
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj.get("config"), dict):
            config.update(obj["config"])
        if "schedule" in obj and "samples_per_s" in obj:
            rows.append(obj)
    if not any(r["schedule"] == "sync" for r in rows):
        raise ValueError(f"{p}: no measured sync row (schedule, samples_per_s) to compare with")
    return rows, config


def _sim_config(
    tm: ProfiledTimeModel,
    cfg: dict[str, Any],
    schedule: str,
    eta: int | None,
    interrupt: bool,
    in_order: bool = True,
) -> SimConfig:
    threads = int(cfg["threads"])
    train = int(cfg["train_threads"] or max(1, threads // 2))
    if schedule == "sync":
        return SimConfig(
            tm,
            parse_lengths(str(cfg["lengths"])),
            schedule="sync",
            n_devices=threads,
            gen_devices_per_replica=threads,
            batch_size=int(cfg["batch_size"]),
            n_steps=int(cfg["n_steps"]),
            prompt_len=int(cfg["prompt_len"]),
            slots_per_replica=int(cfg["slots"]),
            weight_sync_s=0.0,
        )
    if threads < 2:
        raise ValueError("a split schedule needs threads >= 2 (one to generate, one to train)")
    return SimConfig(
        tm,
        parse_lengths(str(cfg["lengths"])),
        schedule=schedule,  # type: ignore[arg-type]
        n_devices=threads,
        train_devices=train,
        gen_devices_per_replica=threads - train,
        batch_size=int(cfg["batch_size"]),
        n_steps=int(cfg["n_steps"]),
        prompt_len=int(cfg["prompt_len"]),
        eta=eta,
        interrupt=interrupt,
        in_order=in_order,
        slots_per_replica=int(cfg["slots"]),
        weight_sync_s=0.0,
    )


def compare(
    profile: MeasuredProfile, rows: list[dict[str, Any]], cfg: dict[str, Any]
) -> dict[str, Any]:
    """Predicted vs measured speedups over sync for every non-sync row."""
    cfg = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if cfg["threads"] is None:
        cfg["threads"] = profile.threads
    tm = ProfiledTimeModel(profile, concurrency=int(cfg["slots"]))
    sync_meas = next(r for r in rows if r["schedule"] == "sync")["samples_per_s"]
    sync_pred = simulate(_sim_config(tm, cfg, "sync", 0, False)).samples_per_s
    out = []
    for r in rows:
        if r["schedule"] == "sync":
            continue
        eta = r.get("eta", 1 if r["schedule"] == "overlap" else None)
        interrupt = bool(r.get("interrupt", True))
        in_order = bool(r.get("in_order", True))
        pred = simulate(_sim_config(tm, cfg, r["schedule"], eta, interrupt, in_order)).samples_per_s
        meas_sp = float(r["samples_per_s"]) / float(sync_meas)
        pred_sp = pred / sync_pred
        out.append(
            {
                "schedule": r["schedule"],
                "eta": eta,
                "interrupt": interrupt,
                "measured_speedup": round(meas_sp, 4),
                "predicted_speedup": round(pred_sp, 4),
                "rel_error": round(abs(pred_sp - meas_sp) / meas_sp, 4),
            }
        )
    worst = max((o["rel_error"] for o in out), default=0.0)
    return {"config": cfg, "rows": out, "max_rel_error": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--schedules", required=True)
    for k in ("batch_size", "n_steps", "prompt_len", "slots", "threads", "train_threads"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    ap.add_argument("--lengths", default=None)
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--check", action="store_true", help="exit 1 if an error exceeds tolerance")
    args = ap.parse_args(argv)
    try:
        profile = MeasuredProfile.load(args.profile)
        rows, cfg = load_schedules(args.schedules)
        for k in (
            "batch_size",
            "n_steps",
            "prompt_len",
            "slots",
            "threads",
            "train_threads",
            "lengths",
        ):
            if getattr(args, k) is not None:
                cfg[k] = getattr(args, k)
        res = compare(profile, rows, cfg)
    except ValueError as exc:
        print(f"plan_calibration: error: {exc}", file=sys.stderr)
        return 2
    res["within_tolerance"] = res["max_rel_error"] <= args.tolerance
    print(f"{'schedule':>9} {'eta':>5} {'int':>5} {'measured':>9} {'predicted':>9} {'error':>7}")
    for o in res["rows"]:
        print(
            f"{o['schedule']:>9} {str(o['eta']):>5} {str(o['interrupt']):>5} "
            f"{o['measured_speedup']:>9.3f} {o['predicted_speedup']:>9.3f} {o['rel_error']:>7.1%}"
        )
    print(json.dumps(res))
    return 1 if args.check and not res["within_tolerance"] else 0


if __name__ == "__main__":
    sys.exit(main())

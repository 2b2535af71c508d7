"""Smoke test of ``bench/trl_grpo.py``'s relayrl side: a 2-step matched GRPO run writes a
checkpoint per evaluated step, its step times come from ``metrics.jsonl``, and the shared
greedy evaluation scores a checkpoint. (TRL's side is not run here: its start-up is slow.)"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import yaml

from relayrl.model import build_tiny_model

BENCH = Path(__file__).resolve().parents[1] / "bench" / "trl_grpo.py"


def _bench():
    spec = importlib.util.spec_from_file_location("trl_grpo_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_relayrl_side_runs_and_is_scored(tmp_path: Path) -> None:
    bench = _bench()
    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    a = argparse.Namespace(steps=2, eval_every=1, prompts=2, group=2, lr=1e-3, target=0.5)
    res = bench.run_relayrl(a, "short", 0, model, tmp_path / "run", matched=True)
    assert sorted(res["checkpoints"]) == [1, 2]
    assert len(res["step_times"]) == 2 and all(t > 0 for t in res["step_times"])
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["algo"]["mini_batches"] == 1 and cfg["optim"]["warmup_steps"] == 0
    prompts = bench.held_out(model, 0, 4)
    row = bench.summarise("relayrl", "short", 0, res, 0.0, prompts, a)
    assert set(row["pass_rate"]) == {"0", "1", "2"}
    assert all(0.0 <= r <= 1.0 for r in row["pass_rate"].values())
    assert row["s_per_step"] > 0 and row["wall_s_to_target"] is None  # untrained: never 0.5

"""``train.save_trajectories``: every trained trajectory of each step as JSONL (token ids, loss
mask, behaviour logprobs, versions, score, transcript, episode info), appended step by step,
and summarised by ``relayrl report``."""

from __future__ import annotations

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.env.export import read_trajectories, summarise
from relayrl.model import build_tiny_model


def test_a_multi_turn_run_saves_every_trained_trajectory(tmp_path):
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    run = tmp_path / "run"
    cfg = run_config(
        model,
        run,
        "data.arithmetic.operators=['*']",
        "data.eval_size=2",
        "env.factory=calculator",
        "env.max_turns=2",
        "rollout.max_tokens=12",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.save_every=0",
        "train.steps=2",
        "train.save_trajectories=true",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = read_trajectories(run)
    steps = sorted({r["step"] for r in recs})
    assert len(steps) == 2, steps
    per_step = summarise(recs)
    assert all(d["trajectories"] >= 4 for d in per_step.values())  # 4 episodes (+ segments)
    for r in recs:
        n = len(r["response_ids"])
        assert len(r["loss_mask"]) == n == len(r["behaviour_logprobs"]) == len(r["versions"])
        assert r["response"] and r["prompt"].startswith("S:tools:calculator")
        if r["segment_of"] is None:
            assert r["stop_reason"] in ("env_done", "max_turns", "token_budget", "context_overflow")
            assert r["messages"][0]["role"] in ("system", "user") and r["turns"] >= 1
        assert isinstance(r["score"], float)
    pytest.importorskip("matplotlib")
    from relayrl.telemetry.report import write_report

    text = write_report([run], tmp_path / "report").read_text()
    assert "## Trajectories" in text

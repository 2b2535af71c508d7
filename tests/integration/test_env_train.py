"""Multi-turn GRPO through the trainer (``relayrl train``'s code path) with the calculator
environment: the sync schedule end to end in the default run, async and PPO in the slow set."""

from __future__ import annotations

import json

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("env-train") / "m", hidden_size=32, seed=1)


def _config(model, run_dir, *overrides):
    return run_config(
        model,
        run_dir,
        "data.arithmetic.operators=['*']",
        "data.arithmetic.min_operand=10",
        "data.arithmetic.max_operand=99",
        "data.eval_size=4",
        "env.factory=calculator",
        "env.max_turns=2",
        "rollout.max_tokens=12",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.save_every=0",
        *overrides,
    )


def _records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def _check_steps(recs, steps, episodes_per_step, exact=True):
    """Each step's env/* counters: in sync exactly the step's episodes; off-policy the episodes
    that finished since the previous step (the engine runs ahead), at least a step's worth in
    all."""
    trained = [r for r in recs if "env/episodes" in r or "reward_mean" in r]
    assert len(trained) == steps
    assert sum(r.get("env/episodes", 0) for r in trained) >= steps * episodes_per_step
    for r in trained:
        n = r.get("env/episodes", 0)
        if exact:
            assert n == episodes_per_step
        stops = sum(v for k, v in r.items() if k.startswith("env/stop_"))
        assert stops == n
        if not n:
            continue
        assert r.get("env/failures", 0) == 0
        assert 1 <= r["env/turns_mean"] <= 2
        assert "reward_mean" in r and "response_length_mean" in r


def test_multi_turn_grpo_runs_end_to_end(tiny_path, tmp_path):
    cfg = _config(tiny_path, tmp_path / "run", "train.steps=2")
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert out["eval_before"] is not None and out["eval_after"] is not None
    _check_steps(_records(tmp_path / "run"), 2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["async", "overlap"])
def test_multi_turn_grpo_async_schedules(tiny_path, tmp_path, schedule):
    cfg = _config(
        tiny_path, tmp_path / "run", "train.steps=3", f"schedule={schedule}", "async.eta=1"
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = _records(tmp_path / "run")
    _check_steps(recs, 3, 4, exact=False)
    assert max(r["staleness_max"] for r in recs if "staleness_max" in r) <= 1
    assert out["eval_after"] is not None


@pytest.mark.slow
def test_multi_turn_ppo_runs(tiny_path, tmp_path):
    cfg = _config(
        tiny_path,
        tmp_path / "run",
        "train.steps=2",
        "algo.name=ppo",
        "algo.group_size=1",
        "algo.prompts_per_step=4",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    _check_steps(_records(tmp_path / "run"), 2, 4)

"""Per-turn credit: discounted turn returns and step-wise GRPO by hand, the runner's turn spans
and per-turn rewards, and GRPO training with ``algo.turn_credit: stepwise_grpo``."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_config
from relayrl.algos.turn_credit import (
    discounted_turn_returns,
    spread_over_turns,
    stepwise_group_advantages,
)
from relayrl.cluster.local import build_local_roles
from relayrl.config import RunConfig
from relayrl.config.io import load_config
from relayrl.controller.trainer import train
from relayrl.env.turn_credit import turn_advantages
from relayrl.model import build_tiny_model
from relayrl.rollout.types import Sample


def test_discounted_turn_returns_by_hand():
    assert discounted_turn_returns([0.5, 0.0, 1.0], 1.0) == [1.5, 1.0, 1.0]
    assert discounted_turn_returns([0.5, 0.0, 1.0], 0.5) == pytest.approx([0.75, 0.5, 1.0])


def test_stepwise_group_advantages_by_hand():
    # group 0: episodes with 2, 2 and 1 turns; group 1: one episode (no peer: 0)
    returns = [[1.0, 1.0], [0.0, 0.0], [2.0], [5.0, 3.0]]
    adv = stepwise_group_advantages(returns, [0, 0, 0, 1], eps=0.0)
    # turn 0 of group 0: returns 1, 0, 2 -> mean 1, std sqrt(2/3)
    s = (2 / 3) ** 0.5
    assert adv[0][0] == pytest.approx(0.0) and adv[1][0] == pytest.approx(-1 / s)
    assert adv[2][0] == pytest.approx(1 / s)
    # turn 1 of group 0: returns 1, 0 -> mean 0.5, std 0.5
    assert adv[0][1] == pytest.approx(1.0) and adv[1][1] == pytest.approx(-1.0)
    assert adv[3] == [0.0, 0.0]
    assert spread_over_turns([1.0, -2.0], [(0, 2), (4, 5)], 6) == [1, 1, 0, 0, -2, 0]


def test_turn_advantages_place_each_turns_value_on_its_tokens():
    def sample(spans, step_rewards, n):
        env = {"turn_spans": spans, "turn_step_rewards": step_rewards}
        return Sample(0, [1], [5] * n, [0.0] * n, [0] * n, "eos", 0, {"env": env})

    a = sample([(0, 2), (4, 6)], [1.0], 6)  # turn rewards 1 then score 1: G = 2, 1
    b = sample([(0, 2), (4, 6)], [0.0], 6)  # 0 then score 0: G = 0, 0
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 2, dtype=torch.float32)
    adv = turn_advantages([a, b], torch.tensor([1.0, 0.0]), mask, [0, 0], eps=0.0)
    assert adv.tolist() == [[1, 1, 0, 0, 1, 1], [-1, -1, 0, 0, -1, -1]]


def test_turn_credit_needs_grpo_groups():
    with pytest.raises(ValueError, match="turn_credit"):
        load_config(
            RunConfig,
            None,
            ["algo.turn_credit=stepwise_grpo", "algo.name=ppo", "algo.group_size=1"],
        )


def test_grpo_trains_with_stepwise_turn_credit(tmp_path):
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    cfg = run_config(
        model,
        tmp_path / "run",
        "data.arithmetic.operators=['*']",
        "data.eval_size=2",
        "env.factory=latency",
        "env.kwargs={latency: 'constant:0', turns: 2}",
        "env.max_turns=2",
        "rollout.max_tokens=6",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.steps=2",
        "train.save_every=0",
        "algo.turn_credit=stepwise_grpo",
        "algo.turn_gamma=0.9",
        "train.save_trajectories=true",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [
        json.loads(x)
        for x in (tmp_path / "run" / "trajectories.jsonl").read_text().split("\n")
        if x
    ]
    assert recs and all(
        len(r.get("turn_spans") or []) == r.get("turns", 1) for r in recs if r["segment_of"] is None
    )

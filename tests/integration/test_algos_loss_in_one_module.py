"""A new policy loss added in one module -- this file -- and trained with (issue 40 item 1).

The loss below has the registry's one signature, ``fn(x: PolicyLossInputs, algo: AlgoConfig)
-> (loss, stats)``, and registers itself with ``@register_policy_loss``. Nothing else is
touched: ``algo.policy_loss=clipped_reinforce`` selects it in a run, on the sync schedule and
(with decoupled PPO's behaviour weight, its ``off_policy="weight"`` default) on the async one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from helpers import run_config
from relayrl.algos import PolicyLossInputs, aggregate_loss, register_policy_loss
from relayrl.cluster.local import build_local_roles
from relayrl.config import AlgoConfig, ConfigError
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model

CALLS: list[dict[str, Any]] = []


@register_policy_loss("clipped_reinforce")
def clipped_reinforce(x: PolicyLossInputs, algo: AlgoConfig) -> tuple[Tensor, dict[str, Any]]:
    """REINFORCE with a bounded ratio weight: loss_t = -A_t * sg(clip(r_t, 1 - eps_low,
    1 + eps_high)) * log pi_t, r_t = pi_t / pi_old_t; times the constant token weights."""
    mask = x.response_mask
    ratio = torch.exp((x.logprobs - x.old_logprobs).detach() * mask)
    bounded = ratio.clamp(1 - algo.clip_eps_low, 1 + algo.clip_eps_high)
    per_token = -x.advantages * bounded * x.logprobs
    if x.token_weights is not None:
        per_token = per_token * x.token_weights
    loss = aggregate_loss(per_token, mask, x.norm)
    CALLS.append({"weights": x.token_weights is not None})
    return loss, {"loss": loss.detach(), "ratio_mean": (ratio * mask).sum() / mask.sum()}


def parity_reward(prompt: str, completion: str, sample: dict) -> float:
    """1 for a completion of even length: the untrained tiny model's answers score apart, so
    the groups' advantages are not all 0 and the loss moves the weights."""
    return float(len(completion) % 2 == 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


TINY = [
    "train.steps=2",
    "algo.prompts_per_step=2",
    "algo.group_size=4",
    "algo.mini_batches=1",
    "rollout.max_tokens=4",
    "data.eval_size=2",
    "algo.policy_loss=clipped_reinforce",
    "reward.fn=test_algos_loss_in_one_module:parity_reward",
]


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_loss_defined_here_trains(tiny: Path, tmp_path: Path, schedule: str) -> None:
    cfg = run_config(tiny, tmp_path / "run", *TINY, f"schedule={schedule}")
    CALLS.clear()
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # its stats, named as every loss's are (pg_*)
        assert "actor/pg_loss" in r and "actor/pg_ratio_mean" in r
    assert CALLS  # the actor called it, micro-batch by micro-batch
    # off the sync schedule it gets the behaviour weight, as the built-in 2025 losses do
    assert all(c["weights"] == (schedule == "async") for c in CALLS)
    if schedule == "async":
        assert all("offpolicy/behav_weight_mean" in r for r in steps)
    assert any(r["actor/pg_loss"] != 0.0 for r in steps)  # it had something to learn from
    saved = tmp_path / "run" / "checkpoints" / "step_000002" / "actor"
    assert saved.is_dir()


def test_an_unregistered_loss_is_refused_before_the_run(tiny: Path, tmp_path: Path) -> None:
    cfg = run_config(tiny, tmp_path / "run", *TINY, "algo.policy_loss=clipped_reinfrce")
    with pytest.raises(ConfigError, match="unknown algo.policy_loss 'clipped_reinfrce'"):
        train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert not (tmp_path / "run").exists()

"""Train/inference mismatch monitor: figures over trained same-version tokens, jump warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from relayrl.telemetry.mismatch import MismatchMonitor, token_mismatch


def test_figures_over_masked_same_version_tokens() -> None:
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    trainer = torch.tensor([[-1.0, -2.5, -9.0], [-0.2, -0.5, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the third column is padding
    out = token_mismatch(behaviour, trainer, mask, threshold=0.4)
    # differences over trained tokens: 0, 0.5, 0.3, 0
    assert out["mismatch/tokens"] == 4
    assert out["mismatch/mean_abs"] == pytest.approx(0.2)
    assert out["mismatch/max_abs"] == pytest.approx(0.5)
    assert out["mismatch/frac_over"] == pytest.approx(0.25)
    versions = torch.tensor([[3, 2, 3], [3, 3, 3]])  # the 0.5 token is stale: left out
    out = token_mismatch(behaviour, trainer, mask, 0.4, versions=versions, trainer_version=3)
    assert out["mismatch/tokens"] == 3
    assert out["mismatch/max_abs"] == pytest.approx(0.3)
    assert out["mismatch/frac_over"] == 0.0


def test_no_tokens_and_shape_error() -> None:
    z = torch.zeros(2, 3)
    assert token_mismatch(z, z, torch.zeros(2, 3), 0.1)["mismatch/tokens"] == 0
    with pytest.raises(ValueError, match=r"mismatch: behaviour \(2, 3\), trainer \(2, 2\)"):
        token_mismatch(z, torch.zeros(2, 2), z, 0.1)


def test_warns_once_when_the_mean_jumps(caplog: pytest.LogCaptureFixture) -> None:
    mon = MismatchMonitor(threshold=0.1, jump_factor=5.0, window=3, min_mean=1e-3)
    mask = torch.ones(1, 4)
    base = torch.zeros(1, 4)
    with caplog.at_level(logging.WARNING, logger="relayrl.telemetry.mismatch"):
        for step, d in enumerate([1e-7, 9e-7, 4e-7]):  # fp noise: 9x, but under the floor
            mon.observe(base, base + d, mask, step=step)
        assert mon.warnings == []
        mon.observe(base, base + 0.5, mask, step=3)
    assert len(mon.warnings) == 1
    assert mon.warnings[0].startswith(
        "step 3: train/inference logprob mismatch jumped: mean |behaviour - trainer| = 0.5"
    )
    assert "100.0% of 4 tokens over 0.1" in caplog.text


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="mismatch threshold must be > 0, got 0"):
        MismatchMonitor(threshold=0)
    with pytest.raises(ValueError, match="mismatch jump_factor must be > 1, got 1"):
        MismatchMonitor(jump_factor=1)


class _Batch(SimpleNamespace):
    """The three tensors and ``response_mask`` an Experience offers the monitor."""

    response_mask = torch.tensor([[1, 1, 0]])


def test_observe_experience_prefers_the_steps_recompute() -> None:
    exp = _Batch(
        behaviour_logprobs=torch.tensor([[-1.0, -2.0, 0.0]]),
        versions=torch.tensor([[4, 4, 0]]),
        old_logprobs=None,
    )
    calls = []

    def forward(batch):
        calls.append(batch)
        return torch.tensor([[-1.5, -2.0, 0.0]])

    mon = MismatchMonitor(threshold=0.1)
    out = mon.observe_experience(exp, forward, trainer_version=4)
    assert len(calls) == 1 and out["mismatch/max_abs"] == pytest.approx(0.5)
    exp.old_logprobs = torch.tensor([[-1.0, -2.25, 0.0]])
    out = mon.observe_experience(exp, forward, trainer_version=4)
    assert len(calls) == 1 and out["mismatch/max_abs"] == pytest.approx(0.25)
    assert mon.observe_experience(exp, forward, trainer_version=5)["mismatch/tokens"] == 0


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_every_schedule_logs_the_mismatch_per_step(tmp_path, schedule) -> None:
    """The own engine's behaviour logprobs against the trainer's, logged per step in every
    schedule (here fp32 on both sides: the mismatch is numerical noise; 1.5e-7 mean, 4.8e-7
    max measured)."""
    import json

    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train
    from relayrl.model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    cfg = run_config(
        model,
        tmp_path / "run",
        f"schedule={schedule}",
        "train.steps=2",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=4",
        "data.eval_size=2",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    # tokens sampled under older weights are left out (their gap is the policy change): an
    # async step may train only those
    assert steps[0]["mismatch/tokens"] > 0
    for r in steps:
        assert 0 <= r["mismatch/mean_abs"] <= r["mismatch/max_abs"] < 1e-4
        if schedule == "sync":
            assert r["mismatch/tokens"] > 0

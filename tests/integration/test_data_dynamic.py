"""DAPO dynamic sampling: the group filter on hand-made groups, and GRPO with dynamic sampling
on the tiny SFT model (one step's mechanics in the default run; learning under -m slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import make_kl_controller
from relayrl.controller.dynamic_sampling import refill_prompts
from relayrl.controller.schedules import SyncSchedule
from relayrl.controller.trainer import train
from relayrl.data import dynamic_sample, has_signal
from relayrl.data.prompts import PromptSource
from relayrl.telemetry.timeline import Timeline


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        ([1, 1, 1], False),
        ([0, 0, 0, 0], False),
        ([0, 1, 0], True),
        ([0.5, 0.5], False),
        ([0.5, 0.25], True),
        ([1.0], False),
        ([], False),
    ],
)
def test_has_signal(outcomes: list[float], expected: bool) -> None:
    assert has_signal(outcomes) is expected


def _generator(rounds: list[list[list[int]]]):
    asked: list[tuple[int, int]] = []

    def generate(rnd: int, n: int) -> list[list[int]]:
        asked.append((rnd, n))
        return rounds[rnd] if rnd < len(rounds) else []

    return generate, asked


def test_dynamic_sample_refills_until_full() -> None:
    flat, mixed = [1, 1], [0, 1]
    generate, asked = _generator(
        [[flat, mixed, flat, mixed], [mixed, flat, mixed, mixed], [mixed] * 9]
    )
    kept, stats = dynamic_sample(generate, lambda g: g, target=4, max_rounds=4)
    assert len(kept) == 4 and all(has_signal(g) for g in kept)
    # round 0 keeps 2 of 4; round 1 asks for (4 - 2) / 0.5 = 4 and fills after 3 of them
    assert asked == [(0, 4), (1, 4)]
    assert stats.rounds == 2 and stats.filled
    assert stats.groups_seen == 7 and stats.groups_dropped == 3
    assert stats.dropped_frac == pytest.approx(3 / 7)
    assert stats.as_metrics()["dynamic/dropped_frac"] == pytest.approx(3 / 7)


def test_dynamic_sample_stops_at_max_rounds() -> None:
    flat = [0, 0]
    generate, asked = _generator([[flat, flat, [0, 1]], [flat] * 3, [flat] * 3, [[1, 0]] * 3])
    kept, stats = dynamic_sample(generate, lambda g: g, target=3, max_rounds=3)
    assert len(kept) == 1 and not stats.filled and stats.rounds == 3
    assert stats.groups_dropped == 8 and [n for _, n in asked] == [3, 3, 3]  # capped at target
    with pytest.raises(ValueError):
        dynamic_sample(generate, lambda g: g, target=0)
    with pytest.raises(ValueError):
        dynamic_sample(generate, lambda g: g, target=1, max_rounds=0)


def test_dynamic_sample_uses_raw_outcome_not_score() -> None:
    # shaped scores differ (e.g. a length penalty) but the verifiable outcome does not
    groups = [[{"score": 0.9, "outcome": 1.0}, {"score": 0.7, "outcome": 1.0}]]
    kept, stats = dynamic_sample(
        lambda r, n: groups if r == 0 else [], lambda g: [s["outcome"] for s in g], 1, 2
    )
    assert kept == [] and stats.groups_dropped == 1


DS = [
    "algo.prompts_per_step=8",
    "algo.group_size=8",
    "data.eval_size=16",
    "data.dynamic_sampling.enabled=true",
    "data.dynamic_sampling.max_rounds=4",
]


@pytest.mark.learning
def test_grpo_step_with_dynamic_sampling(sft_model: Path, tmp_path: Path, outcome) -> None:
    """32 groups of 8 at temperature 1 from the ~35% fixture: some are flat (all right or all
    wrong), are dropped and refilled. With 8 groups none was flat on one seed of five (a
    group is flat with p ~0.2: 0.8^8 = 17%); with 32, 0.8^32 < 0.1%. Measured over seeds
    0-4 (min / median): dropped fraction 0.11 / 0.24, 2 / 2 rounds."""
    cfg = run_config(sft_model, tmp_path / "ds", *DS, "algo.prompts_per_step=32")
    roles = build_local_roles(cfg, str(sft_model), None)
    source = PromptSource(cfg.data, roles.tokenizer, cfg.seed)
    prompts = source.for_step(0, cfg.algo.prompts_per_step)
    stop = [roles.tokenizer.eos_token_id]
    refill = refill_prompts(source, 0, cfg.data.dynamic_sampling.max_rounds)
    schedule = SyncSchedule(roles, cfg, source, stop, Timeline())
    exp, stats = schedule.step(0, make_kl_controller(cfg))  # the same seeded draw as `prompts`
    outcome(dropped_frac=stats["dynamic/dropped_frac"], rounds=stats["dynamic/rounds"])
    assert 0.0 < stats["dynamic/dropped_frac"] < 1.0  # ~37% pass rate: some groups are flat
    assert stats["dynamic/filled"] == 1.0 and stats["dynamic/rounds"] >= 2
    assert len(exp) == 32 * 8
    groups = exp.group_index
    assert sorted(set(groups.tolist())) == list(range(32))
    for g in range(32):
        s = exp.scores[groups == g]
        assert s.numel() == 8 and s.max() > s.min()  # every kept group carries signal
        adv = exp.advantages[groups == g]
        assert torch.count_nonzero(adv) > 0
    # refills are fresh prompts, not the step's own
    first = {p.record.prompt for p in prompts}
    assert {p.record.prompt for p in refill(1, 32)} != first


def test_train_logs_dropped_fraction(sft_model: Path, tmp_path: Path) -> None:
    cfg = run_config(sft_model, tmp_path / "run", "train.steps=2", *DS)
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0.0 <= r["dynamic/dropped_frac"] < 1.0 and "dynamic/raw_pass_rate" in r


@pytest.mark.slow
@pytest.mark.learning
def test_grpo_with_dynamic_sampling_learns(sft_model: Path, tmp_path: Path, outcome) -> None:
    cfg = run_config(
        sft_model,
        tmp_path / "learn",
        "train.steps=40",
        "algo.prompts_per_step=32",
        "algo.group_size=8",
        "data.eval_size=200",
        "data.dynamic_sampling.enabled=true",
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.1, out
    rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    dropped = [r["dynamic/dropped_frac"] for r in rows if "dynamic/dropped_frac" in r]
    assert len(dropped) == 40 and max(dropped) > 0

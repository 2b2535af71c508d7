"""Issue 43, the rest of "a group left with fewer than 2 is regenerated or dropped": the sync
schedule regenerates such a group with a fresh prompt, drawn as dynamic sampling refills
(``controller.dynamic_sampling.regenerate_small_groups``), and counts it.

The async schedules replace such a group by the next admission, as dynamic sampling does.

Real components: the tiny model's engine, the inline reward worker running
``failure_helpers:fails_on_prompts`` (on a fixed half of the prompts every sample but the first
raises: an infrastructure failure that leaves the group 1 sample), the arithmetic prompt
source, the sync schedule and ``FailureLog``.
"""

from __future__ import annotations

import json

import pytest
import torch

from failure_helpers import prompt_fails
from helpers import SMALL_STEP, run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import admit
from relayrl.controller.dynamic_sampling import REFILL_STEP_BASE
from relayrl.controller.failures import FailureLog, small_groups
from relayrl.controller.schedules import SyncSchedule
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model
from relayrl.rollout.types import Sample
from relayrl.telemetry.timeline import Timeline


def _sample(group: int, **metadata) -> Sample:
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", group, dict(metadata))


def test_small_groups_rule():
    """n_left < n and n_left < 2: group 0 keeps 1 of 3, group 1 keeps 2 of 3, group 2 lost
    nothing (a singleton group that never failed stays), group 3 lost its only sample."""
    bad = {"reward": {"error": "f: ValueError: boom"}}
    samples = [
        *[_sample(0), _sample(0, **bad), _sample(0, **bad)],
        *[_sample(1), _sample(1), _sample(1, **bad)],
        _sample(2),
        _sample(3, **bad),
    ]
    assert small_groups(samples) == [0, 3]
    assert small_groups(samples, min_group=3) == [0, 1, 3]
    kept, _ = FailureLog().admit(samples, torch.zeros(len(samples)))
    assert [s.group_id for s in kept] == [1, 1, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("regen") / "m", hidden_size=32, seed=1)


def _cfg(tiny, run_dir, *overrides):
    return run_config(
        tiny,
        run_dir,
        *SMALL_STEP,
        "reward.fn=failure_helpers:fails_on_prompts",
        "failures.retries=1",
        "failures.regenerate_rounds=2",
        *overrides,
    )


def test_a_group_left_with_one_sample_is_regenerated_with_a_fresh_prompt(tiny, tmp_path):
    """Hand-checked draws (seed of tests/support/helpers.py, arithmetic task, B = 4, G = 4,
    2 rounds):

    step 1 draws 65+53, 91+57, 93+2, 64+30; groups 0, 1, 3 fail (1 sample left each). Round 1
    (refill index 10_000_000 + 1 * 3 + 1) draws 87+56, 21+1, 17+27 for them: 21+1 and 17+27
    fail too. Round 2 (index + 1) draws 62+61, 90+3 for groups 1 and 3: both succeed. So 3 +
    2 = 5 group regenerations, none dropped, the batch holds 4 groups of 4: 87+56, 62+61, 93+2,
    90+3. Retries (1 each): 3 x 3 failed samples in the first draw, 2 x 3 in round 1 = 15.

    step 0 draws 35+29, 30+64, 45+48, 70+41; group 2 fails, and so do its round-1 (48+69) and
    round-2 (16+97) draws: 2 regenerations, then the group is dropped: 3 groups train, its 3
    failed samples are counted as left out (reward_fn)."""
    cfg = _cfg(tiny, tmp_path / "run")
    roles = build_local_roles(cfg, str(tiny), None)
    try:
        tok = roles.tokenizer
        source = PromptSource(cfg.data, tok, cfg.seed)
        schedule = SyncSchedule(roles, cfg, source, [tok.eos_token_id], Timeline())

        # the hand-checked draws follow from the refill rule and prompt_fails
        first = [p.record.prompt for p in source.for_step(1, 4)]
        assert first == ["65+53=", "91+57=", "93+2=", "64+30="]
        assert [prompt_fails(p) for p in first] == [True, True, False, True]
        r1 = [p.record.prompt for p in source.for_step(REFILL_STEP_BASE + 1 * 3 + 1, 3)]
        r2 = [p.record.prompt for p in source.for_step(REFILL_STEP_BASE + 1 * 3 + 2, 2)]
        assert (r1, r2) == (["87+56=", "21+1=", "17+27="], ["62+61=", "90+3="])
        assert [prompt_fails(p) for p in r1 + r2] == [False, True, True, False, False]

        samples, scores, stats = schedule.rollout(1)
        assert len(samples) == 16 and scores.shape == (16,)
        assert stats["failures/retried"] == 15
        kept, kept_scores, _ = admit(roles, cfg, schedule.failures, samples, scores)
        m = schedule.failures.metrics()
        assert m["failures/groups_regenerated"] == 5
        assert m.get("failures/groups_dropped", 0) == 0
        assert m["failures/samples"] == 16 and m["failures/infra"] == 0
        assert len(kept) == 16 and len(kept_scores) == 16  # the full number of groups
        by_group = {s.group_id: s.metadata["prompt"] for s in kept}
        assert by_group == {0: "87+56=", 1: "62+61=", 2: "93+2=", 3: "90+3="}
        assert not set(by_group.values()) & {"65+53=", "91+57=", "64+30="}  # fresh draws
        for g in range(4):  # each group: one prompt, its 4 answers in order
            group = [s for s in kept if s.group_id == g]
            assert [s.metadata["sample_index"] for s in group] == [0, 1, 2, 3]

        samples, scores, stats = schedule.rollout(0)
        kept, _, _ = admit(roles, cfg, schedule.failures, samples, scores)
        m = schedule.failures.metrics()
        assert m["failures/groups_regenerated"] == 2 and m["failures/groups_dropped"] == 1
        assert m["failures/infra"] == 3 and m["failures/infra/reward_fn"] == 3
        assert stats["failures/retried"] == 3 * 3  # 3 failed samples, in 3 draws, once each
        assert sorted({s.metadata["prompt"] for s in kept}) == ["30+64=", "35+29=", "70+41="]
        assert len(kept) == 12
    finally:
        roles.close()


def test_training_with_groups_regenerated_counts_them_per_step(tiny, tmp_path):
    """Through ``train``: every step's record has ``failures/groups_regenerated`` (0 included),
    the draws are those above (a prompt's failures do not depend on the weights)."""
    cfg = _cfg(tiny, tmp_path / "run", "train.steps=2")
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "failures/samples" in r]
    assert [r["failures/groups_regenerated"] for r in steps] == [2, 5]
    assert [r.get("failures/groups_dropped", 0) for r in steps] == [1, 0]
    assert [r["failures/infra"] for r in steps] == [3, 0]


def test_async_replaces_a_group_left_with_one_sample(tiny, tmp_path):
    """``overlap``: a group that ``fails_on_prompts`` leaves with 1 sample goes back to the
    staleness gate and a fresh admission replaces it, so every step trains 4 whole groups (16
    samples, none left out); the replacements are counted (up to 4 x 4 per version: enough
    for half the prompts failing)."""
    cfg = _cfg(
        tiny, tmp_path / "run", "train.steps=3", "schedule=overlap", "failures.regenerate_rounds=4"
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "failures/samples" in r]
    assert len(steps) == 3
    assert all(r["failures/samples"] == 16 and r["failures/infra"] == 0 for r in steps), steps
    assert all(r.get("failures/groups_dropped", 0) == 0 for r in steps)
    assert sum(r["failures/groups_regenerated"] for r in steps) > 0

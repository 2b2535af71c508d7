"""``algo.missing_eos_penalty`` (TRL's ``missing_eos_penalty``): a response cut at the token
limit (finish reason ``length``) trains on score - penalty; its raw outcome (pass rate) is kept,
an infrastructure failure is never scored, and a split episode is penalised on every segment
(counted once)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import admit, missing_eos_penalty, scored_experience
from relayrl.controller.failures import FailureLog
from relayrl.rollout.types import Sample


def _sample(group: int, finish: str, **metadata) -> Sample:
    return Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], finish, group, dict(metadata))  # type: ignore[arg-type]


def _roles() -> SimpleNamespace:
    return SimpleNamespace(
        tokenizer=SimpleNamespace(pad_token_id=0),
        reward=SimpleNamespace(outcomes=lambda samples, scores: scores),  # no service: raw
    )


def test_penalty_comes_off_the_truncated_rows_only():
    samples = [_sample(0, "eos"), _sample(0, "length"), _sample(1, "stop"), _sample(1, "length")]
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5])
    out, n = missing_eos_penalty(samples, scores, [0, 1, 2, 3], 0.25)
    # [1.0, 1.0 - 0.25, 0.0, 0.5 - 0.25]
    torch.testing.assert_close(out, torch.tensor([1.0, 0.75, 0.0, 0.25]))
    assert n == 2


def test_a_split_episode_is_penalised_on_every_segment_and_counted_once():
    """Rows 0-1 are episode 0 (a segment, then the episode's own sample, cut at the limit);
    row 2 is episode 1 (a segment cut at the limit is not the episode's end: no penalty)."""
    samples = [_sample(0, "stop"), _sample(0, "length"), _sample(1, "length"), _sample(1, "eos")]
    scores = torch.tensor([2.0, 2.0, 1.0, 1.0])
    out, n = missing_eos_penalty(samples, scores, [0, 0, 1, 1], 0.5)
    torch.testing.assert_close(out, torch.tensor([1.5, 1.5, 1.0, 1.0]))
    assert n == 1


def test_scored_experience_trains_penalised_scores_and_keeps_the_raw_outcome():
    cfg = load_config(RunConfig, None, ["algo.missing_eos_penalty=1.0"])
    samples = [_sample(0, "length"), _sample(0, "eos")]
    stats: dict[str, float] = {}
    exp = scored_experience(_roles(), cfg, samples, torch.tensor([1.0, 1.0]), [0, 1], stats)
    torch.testing.assert_close(exp.scores, torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(exp.outcomes, torch.tensor([1.0, 1.0]))
    assert stats == {"missing_eos/penalised": 1.0}
    off = load_config(RunConfig, None, [])
    stats = {}
    exp = scored_experience(_roles(), off, samples, torch.tensor([1.0, 1.0]), [0, 1], stats)
    torch.testing.assert_close(exp.scores, torch.tensor([1.0, 1.0]))
    assert stats == {}  # off: no metric


def test_an_infrastructure_failure_is_dropped_before_it_could_be_penalised():
    """A reward worker failure cut at the limit: left out by ``admit``, so neither scored nor
    counted; its group-mates train (group of 3, 2 left)."""
    cfg = load_config(RunConfig, None, ["algo.missing_eos_penalty=0.5", "algo.group_size=3"])
    bad = {"reward": {"error": "f: ValueError: boom"}}
    samples = [_sample(0, "length", **bad), _sample(0, "length"), _sample(0, "eos")]
    failures = FailureLog()
    kept, scores, episodes = admit(_roles(), cfg, failures, samples, torch.tensor([0.0, 1.0, 1.0]))
    assert kept == samples[1:]
    stats: dict[str, float] = {}
    exp = scored_experience(_roles(), cfg, kept, scores, episodes, stats)
    torch.testing.assert_close(exp.scores, torch.tensor([0.5, 1.0]))
    assert stats["missing_eos/penalised"] == 1.0
    assert failures.metrics()["failures/infra"] == 1

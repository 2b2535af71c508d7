"""``PromptSource.for_step`` over a training file: epochs of seeded shuffles, each epoch's
permutation built once, so a step costs O(prompts drawn) whatever the file's size; draws are a
pure function of (seed, step, n), so a resumed run (a fresh source) draws what a straight run
draws."""

from __future__ import annotations

import random

import pytest

from relayrl.config import RunConfig, load_config
from relayrl.data import PromptRecord
from relayrl.data.prompts import PromptSource, TokenizedPrompt
from relayrl.data.prompts import source as prompts_mod


def _cfg():
    return load_config(RunConfig, None, ["data.task=jsonl", "data.train_path=unused.jsonl"]).data


def _rows(rows: int) -> list[TokenizedPrompt]:
    return [TokenizedPrompt(PromptRecord(f"p{i}", str(i)), [i % 97 + 3]) for i in range(rows)]


def _source(rows: int | list[TokenizedPrompt], seed: int) -> PromptSource:
    train = _rows(rows) if isinstance(rows, int) else rows
    return PromptSource.from_prompts(train, train[:1], _cfg(), tokenizer=None, seed=seed)


def _reference(rows: int, seed: int, step: int, n: int) -> list[str]:
    """The definition, by hand: stream position p = step * n + j is row order_e[p mod rows] of
    epoch e = p // rows, order_e = random.Random(seed * 1_000_003 + e).shuffle(range(rows))."""
    out = []
    for pos in range(step * n, step * n + n):
        epoch, i = divmod(pos, rows)
        order = list(range(rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(f"p{order[i]}")
    return out


def test_draws_follow_the_definition_across_epoch_boundaries() -> None:
    src = _source(50, seed=7)
    # 8 does not divide 50: steps 6, 12, 18 straddle an epoch boundary
    for step in range(20):
        got = [p.record.prompt for p in src.for_step(step, 8)]
        assert got == _reference(50, 7, step, 8), step
    # each epoch visits every row once
    epoch0 = [p.record.prompt for s in range(5) for p in src.for_step(s, 10)]
    assert sorted(epoch0) == sorted(f"p{i}" for i in range(50))
    assert epoch0 != [f"p{i}" for i in range(50)]  # shuffled
    assert [p.record.prompt for p in _source(50, seed=8).for_step(0, 10)] != epoch0[:10]


def test_a_fresh_source_resumes_exactly_and_the_cache_stays_bounded(monkeypatch) -> None:
    straight = _source(30, seed=3)
    order_of_calls = [0, 1, 2, 10_000_000, 3, 10_000_001, 4, 5, 6, 7, 8, 9, 2]
    seen = {s: [p.record.prompt for p in straight.for_step(s, 7)] for s in order_of_calls}
    assert len(straight._orders) <= prompts_mod.EPOCH_CACHE
    for s in order_of_calls:  # a resumed run: a new source, no sampler state carried over
        assert [p.record.prompt for p in _source(30, seed=3).for_step(s, 7)] == seen[s]
        assert seen[s] == _reference(30, 3, s, 7)
    # a permutation is built once per epoch, not per prompt
    built = []
    real = prompts_mod.epoch_order
    monkeypatch.setattr(prompts_mod, "epoch_order", lambda *a: built.append(a[1]) or real(*a))
    fresh = _source(30, seed=3)
    for s in range(30):
        fresh.for_step(s, 7)
    assert built == list(range(7))  # 30 steps x 7 = 210 positions = 7 epochs of 30


def _step_work(src: PromptSource, steps: list[int], monkeypatch, n: int = 64) -> list[tuple]:
    """Per step: (permutations built, rows of the file read): the work a step does, counted
    (a clock would be the machine's load as much as the code's)."""
    built: list[int] = []
    real = prompts_mod.epoch_order
    monkeypatch.setattr(prompts_mod, "epoch_order", lambda *a: built.append(a[1]) or real(*a))
    read: list[int] = []
    real_get = src._cache.get
    monkeypatch.setattr(src._cache, "get", lambda rows: read.append(len(rows)) or real_get(rows))
    out = []
    for s in steps:
        built.clear(), read.clear()
        src.for_step(s, n)
        out.append((len(built), sum(read)))
    return out


@pytest.mark.parametrize(
    "rows", [100_000, pytest.param(1_000_000, marks=pytest.mark.slow)], ids=["100k", "1M"]
)
def test_per_step_work_is_flat_in_the_file_size(rows: int, monkeypatch) -> None:
    """A step reads its n rows and builds no permutation but on the first step of an epoch,
    at any file size (the old code reshuffled the file per prompt drawn: O(rows) a prompt).
    Counted, not timed. (1M rows is in the slow set: building a million prompt objects takes
    8-35 s here.)"""
    million = _rows(rows)
    small, big = _source(2_048, seed=0), _source(million, seed=0)
    assert _step_work(big, [0], monkeypatch) == [(1, 64)]  # epoch 0's permutation, once
    steps = [1, 1, 50, *range(2, 42)]
    assert _step_work(big, steps, monkeypatch) == [(0, 64)] * len(steps)
    _step_work(small, [0], monkeypatch)
    assert _step_work(small, list(range(2, 30)), monkeypatch) == [(0, 64)] * 28
    # resume across the file's first epoch boundary (position rows - 32 .. rows + 31)
    last = rows // 64
    for step in (last - 1, last):
        drawn = [p.record.prompt for p in big.for_step(step, 64)]
        assert drawn == [p.record.prompt for p in _source(million, 0).for_step(step, 64)]


def test_from_prompts_needs_training_prompts() -> None:
    with pytest.raises(ValueError, match="no training prompts"):
        _source(0, seed=0)

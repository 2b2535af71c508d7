"""A training file's prompts are tokenised when first drawn: start-up reads and checks the
rows but tokenises only a bounded sample; over-long prompts are skipped at draw time by a
seeded redraw (a pure function of (seed, position): resume stays exact); the held-out eval
set and the draws are those of tokenising everything first when no prompt is over-long."""

from __future__ import annotations

import json
import random
import time

import pytest

from relayrl.config import RunConfig, load_config
from relayrl.data import DataError
from relayrl.data.prompts import PromptSource, load_prompts
from relayrl.data.prompts import source as source_mod
from relayrl.data.prompts.read import records_row_by_row
from relayrl.model import build_tiny_model, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16))


def _write(path, prompts):
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": p, "answer": i, "level": i % 3}) + "\n")
    return path


def _cfg(path, *extra):
    return load_config(RunConfig, None, ["data.task=jsonl", f"data.train_path={path}", *extra]).data


def _long(i: int) -> bool:
    return i % 7 == 3


def _prompts(rows: int) -> list[str]:
    # every 7th prompt (i % 7 == 3) is 120 characters: over data.max_prompt_tokens=64
    return [("9" * 120 if _long(i) else f"{i}+1=") for i in range(rows)]


def test_rows_load_like_records_and_bad_rows_keep_their_errors(tmp_path) -> None:
    path = _write(tmp_path / "t.jsonl", _prompts(20))
    assert list(load_prompts(path)) == records_row_by_row(path)
    with path.open("a") as f:
        f.write('\n{"prompt": "x", "answer": true}\n')
    with pytest.raises(DataError, match=r"t.jsonl:22: field 'answer' must be a string or number"):
        load_prompts(path)
    (tmp_path / "m.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    assert list(load_prompts(tmp_path / "m.jsonl")) == records_row_by_row(tmp_path / "m.jsonl")


def test_over_long_prompts_are_redrawn_at_draw_time(tmp_path, tok, monkeypatch) -> None:
    """A file over PRETOKENIZE rows (made small here): nothing over-long is ever drawn, each
    step still has n prompts, the skips are counted once per row as found, and a fresh
    source (a resume) draws the same prompts at any step."""
    monkeypatch.setattr(source_mod, "PRETOKENIZE", 16)
    path = _write(tmp_path / "t.jsonl", _prompts(700))
    cfg = _cfg(path, "data.max_prompt_tokens=64", "data.eval_size=20")
    src = PromptSource(cfg, tok, seed=1)
    assert src._cache.seen <= 16 + 40  # the start sample and the held-out draws, no more
    eval_prompts = [p.record.prompt for p in src.eval_set()]
    assert len(set(eval_prompts)) == 20 and not any(p.startswith("999") for p in eval_prompts)
    seen: list[str] = []
    for step in range(12):
        got = src.for_step(step, 64)
        assert len(got) == 64 and all(len(p.ids) <= 64 for p in got)
        seen += [p.record.prompt for p in got]
        fresh = PromptSource(cfg, tok, seed=1)
        assert [p.record.prompt for p in fresh.for_step(step, 64)] == seen[-64:]
    assert not set(seen) & set(eval_prompts)
    # 12 x 64 = 768 draws over 680 training rows: > 1 epoch; the ~1/7 over-long rows of the
    # epoch were found and counted once each
    n_long = sum(_long(i) for i in range(700))
    assert 0.8 * n_long <= src.skipped <= n_long
    assert PromptSource(cfg, tok, seed=2).for_step(0, 64) != src.for_step(0, 64)


def test_without_over_long_prompts_draws_match_tokenising_everything(tmp_path, tok) -> None:
    """The definition by hand: the training rows are the file's rows less the held-out
    prompts, in file order; epoch e visits them in random.Random(seed * 1_000_003 + e)'s
    shuffle; the eval set is random.Random('relayrl.hold_out:seed').sample(distinct, n)."""
    rows = 5000  # over PRETOKENIZE: the lazy path
    prompts = [f"{i % 4000}+{i // 4000}=" for i in range(rows)]
    path = _write(tmp_path / "t.jsonl", prompts)
    cfg = _cfg(path, "data.eval_size=30")
    src = PromptSource(cfg, tok, seed=4)
    chosen = set(random.Random("relayrl.hold_out:4").sample(list(dict.fromkeys(prompts)), 30))
    assert {p.record.prompt for p in src.eval_set()} == chosen
    train = [p for p in prompts if p not in chosen]
    order = list(range(len(train)))
    random.Random(4 * 1_000_003).shuffle(order)
    assert [p.record.prompt for p in src.for_step(3, 50)] == [train[i] for i in order[150:200]]
    assert src.skipped == 0


def test_a_file_of_only_over_long_prompts_is_an_error_at_start(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(source_mod, "PRETOKENIZE", 4)
    path = _write(tmp_path / "t.jsonl", ["9" * 120] * 10)
    cfg = _cfg(path, "data.max_prompt_tokens=64", f"data.eval_path={path}")
    with pytest.raises(DataError, match="10 of 10 prompts in .* are longer than"):
        PromptSource(cfg, tok, seed=0)


@pytest.mark.parametrize(
    "rows", [100_000, pytest.param(1_000_000, marks=pytest.mark.slow)], ids=["100k", "1M"]
)
def test_a_large_file_starts_without_tokenising_it(tmp_path, tok, rows) -> None:
    """Start-up tokenises PRETOKENIZE rows plus the held-out set, not the file (measured on
    the 2-core machine: 1M rows start in ~4-8 s; tokenising them all took ~45-130 s); a step
    that tokenises its 64 new prompts costs the same at any file size."""
    with (tmp_path / "t.jsonl").open("w") as f:
        for i in range(rows):
            f.write(f'{{"prompt": "{i % 1000}+{i // 1000}=", "answer": {i}}}\n')
    t = time.perf_counter()
    src = PromptSource(_cfg(tmp_path / "t.jsonl"), tok, seed=0)
    start = time.perf_counter() - t
    print(f"{rows} rows: start {start:.2f} s")
    assert src._cache.seen <= source_mod.PRETOKENIZE + 400
    assert start < 60.0
    first_epoch = source_mod.PRETOKENIZE // 64 + 1  # steps whose prompts are not tokenised yet
    times = []
    for step in range(first_epoch, first_epoch + 20):
        t = time.perf_counter()
        got = src.for_step(step, 64)
        times.append(time.perf_counter() - t)
        assert len(got) == 64
    per_step = sorted(times)[10]
    print(f"{rows} rows: median step (tokenising 64 prompts) {1e3 * per_step:.2f} ms")
    assert per_step < 0.5  # ~3-10 ms here; tokenising a million rows per step would be minutes

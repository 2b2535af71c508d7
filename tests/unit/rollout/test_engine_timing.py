"""``relayrl.rollout.timing``: the planner's generation figures measured through the engine.

The fit is tested with an injected clock whose steps cost what a known line says (a busy
machine cannot reorder two timings of a fake clock); the real clock only runs a smoke test
that asserts no order or ratio between two timings."""

from __future__ import annotations

import pytest
import torch

from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.plan.timemodel import MeasuredProfile, ProfiledTimeModel
from relayrl.rollout import RolloutEngine
from relayrl.rollout.timing import engine_timings

OVERHEAD, PER_PROMPT_TOKEN, PER_ROW, PER_CACHED_TOKEN = 2e-3, 1e-5, 3e-4, 2e-7


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("timing") / "m", hidden_size=32, seed=0)
    tok = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    return RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=8
    )


def cost_clock(engine: RolloutEngine, scale_prefill: float = 1.0):
    """A clock that moves only in ``engine.step``, by a known cost of what the step runs:
    ``OVERHEAD + PER_PROMPT_TOKEN * prompt tokens admitted + PER_ROW * decode rows +
    PER_CACHED_TOKEN * their cached tokens`` (prefill tokens scaled by ``scale_prefill``)."""
    now = [0.0]
    real_step = engine.step

    def step():
        sched = engine.scheduler
        admitted = sum(len(s.tokens) for s in sched.waiting)
        cached = sum(len(s.tokens) for s in sched.running.values())
        cost = OVERHEAD + PER_PROMPT_TOKEN * admitted * scale_prefill
        now[0] += cost + PER_ROW * len(sched.running) + PER_CACHED_TOKEN * cached
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    return lambda: now[0], lambda: delattr(engine, "step")


def test_the_fit_recovers_the_clocks_line_and_feeds_the_time_model(engine):
    clock, restore = cost_clock(engine)
    try:
        with torch.inference_mode():
            m = engine_timings(
                engine, 32, batches=(1, 8), context=16, decode_steps=3, repeats=2, clock=clock
            )
    finally:
        restore()
    assert not engine.has_unfinished()  # every probe request drained
    # decode: the median step is the second after the prefill, rows of context + 2 tokens
    for b in (1, 8):
        want = OVERHEAD + PER_ROW * b + PER_CACHED_TOKEN * b * (16 + 2)
        assert m["decode_step_s"][b] == pytest.approx(want, rel=1e-9)
    assert m["decode_s_per_ctx_token"] == pytest.approx(PER_CACHED_TOKEN, rel=1e-6)
    # prefill: the line through (16 tokens, small) and (4 x 64 tokens, big)
    assert m["prefill_s"] == pytest.approx(
        {"1x16": OVERHEAD + 16 * PER_PROMPT_TOKEN, "4x64": OVERHEAD + 256 * PER_PROMPT_TOKEN}
    )
    rate, over = m["prefill_tokens_per_s"], m["prefill_overhead_s"]
    assert rate == pytest.approx(1 / PER_PROMPT_TOKEN) and over == pytest.approx(OVERHEAD)
    prof = MeasuredProfile(
        model="m", params=1.0, device="cpu", threads=1, dtype="float32", decode_context=16,
        decode_step_s=m["decode_step_s"], decode_s_per_ctx_token=m["decode_s_per_ctx_token"],
        prefill_tokens_per_s=rate, train_tokens_per_s=1e4, prefill_overhead_s=over,
    )  # fmt: skip
    assert ProfiledTimeModel(prof).prefill_time(256, 1) == pytest.approx(over + 256 / rate)


def test_a_big_prefill_measured_faster_clamps_the_line(engine):
    """What a busy machine produced (the big prefill timed below the small one): the slope is
    clamped at a tiny positive figure and the overhead at >= 0, no error, no negative rate."""
    clock, restore = cost_clock(engine, scale_prefill=-0.01)  # more tokens, less time
    try:
        with torch.inference_mode():
            m = engine_timings(engine, 32, batches=(1,), context=8, decode_steps=1, clock=clock)
    finally:
        restore()
    assert m["prefill_s"]["4x64"] < m["prefill_s"]["1x16"]
    assert m["prefill_tokens_per_s"] == pytest.approx(1e12)
    assert m["prefill_overhead_s"] == pytest.approx(m["prefill_s"]["1x16"])


def test_engine_timings_on_the_real_clock(engine):
    """A smoke test: every figure is there and positive (no order between two timings)."""
    with torch.inference_mode():
        m = engine_timings(engine, 32, batches=(1, 8), context=16, decode_steps=2, repeats=1)
    assert set(m["decode_step_s"]) == {1, 8} and min(m["decode_step_s"].values()) > 0
    assert m["prefill_tokens_per_s"] > 0 and m["prefill_overhead_s"] >= 0
    assert set(m["prefill_s"]) == {"1x16", "4x64"} and not engine.has_unfinished()
    with pytest.raises(ValueError, match="slots"):
        engine_timings(engine, 32, batches=(16,))

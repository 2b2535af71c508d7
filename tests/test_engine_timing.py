"""``relayrl.rollout.timing``: the planner's generation figures measured through the engine."""

from __future__ import annotations

import pytest
import torch

from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.plan.timemodel import MeasuredProfile, ProfiledTimeModel
from relayrl.rollout import RolloutEngine
from relayrl.rollout.timing import engine_timings


def test_engine_timings_fit_the_prefill_line_and_feed_the_time_model(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=32, seed=0)
    tok = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=8
    )
    with torch.inference_mode():
        m = engine_timings(engine, 32, batches=(1, 8), context=16, decode_steps=3, repeats=2)
    assert set(m["decode_step_s"]) == {1, 8} and min(m["decode_step_s"].values()) > 0
    assert not engine.has_unfinished()  # every probe request drained
    # the line through the two prefill measurements: overhead + tokens / rate
    small, big = m["prefill_s"]["1x16"], m["prefill_s"]["4x64"]
    rate, over = m["prefill_tokens_per_s"], m["prefill_overhead_s"]
    assert over >= 0 and rate > 0
    assert big == pytest.approx(over + 256 / rate, rel=1e-6)
    if over > 0:  # else clamped: the short prefill was below the line's intercept
        assert small == pytest.approx(over + 16 / rate, rel=1e-6)
    prof = MeasuredProfile(
        model="m", params=1.0, device="cpu", threads=1, dtype="float32", decode_context=16,
        decode_step_s=m["decode_step_s"], decode_s_per_ctx_token=m["decode_s_per_ctx_token"],
        prefill_tokens_per_s=rate, train_tokens_per_s=1e4, prefill_overhead_s=over,
    )  # fmt: skip
    assert ProfiledTimeModel(prof).prefill_time(256, 1) == pytest.approx(over + 256 / rate)
    with pytest.raises(ValueError, match="slots"):
        engine_timings(engine, 32, batches=(16,))

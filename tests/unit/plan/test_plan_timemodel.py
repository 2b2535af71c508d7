"""Specs, HF config reading and the roofline / profiled time models."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayrl.plan.hardware import get_hardware
from relayrl.plan.models import MODELS, ModelSpec, get_model
from relayrl.plan.timemodel import (
    MeasuredProfile,
    ProfiledTimeModel,
    RooflineTimeModel,
    steps_time,
    steps_within,
)

QWEN7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


def test_hardware_specs():
    h100 = get_hardware("H100-SXM")
    assert h100.peak_flops == 989e12 and h100.mem_bandwidth == 3.35e12
    assert get_hardware("h200").memory_bytes == 141e9
    assert get_hardware("a100").ridge_point == pytest.approx(156, rel=0.03)  # lecture 25
    assert get_hardware("h800").intra_node_bandwidth < h100.intra_node_bandwidth
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu")


def test_hf_config_reading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN7B))
    m = ModelSpec.from_hf_config(tmp_path)
    assert m.params == pytest.approx(7.62e9, rel=2e-3)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (28, 3584, 28, 4, 128)
    assert m.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # GQA: 57 KB per token
    assert get_model(str(tmp_path)).params == m.params
    assert MODELS["qwen2.5-7b"].params == m.params
    assert MODELS["llama-2-70b"].params == pytest.approx(6.9e10, rel=0.01)
    assert MODELS["llama-2-7b"].params == pytest.approx(6.74e9, rel=0.01)
    gpt2 = ModelSpec.from_hf_config(
        {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}
    )
    assert gpt2.params == pytest.approx(124e6, rel=0.02)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(ValueError, match="JSON"):
        ModelSpec.from_hf_config(tmp_path / "bad")
    with pytest.raises(ValueError, match="unknown model"):
        get_model("no-such-model")


def test_lecture19_train_rate_and_decode_same_order():
    tm = RooflineTimeModel(get_model("qwen2.5-7b"), get_hardware("h100"), 0.6, 0.4)
    # "每块卡每秒训练约 8.7k 个 token": 989e12 * 0.4 / (6 * 7.62e9)
    assert round(tm.train_tokens_per_s() / 1e3, 1) == 8.7
    dec = tm.decode_tokens_per_s(64, 256 + 637)
    assert 0.7 < dec / tm.train_tokens_per_s() < 1.3  # decode per token is not much dearer
    # memory-bound: a step of 1 sequence reads the weights at 60% of 3.35 TB/s
    assert tm.decode_step_time(1, 0) == pytest.approx(15.23e9 / (3.35e12 * 0.6), rel=2e-3)
    # tensor parallel halves the bytes per device
    assert tm.decode_step_time(1, 0, devices=2) == pytest.approx(tm.decode_step_time(1, 0) / 2)
    # compute-bound past the ridge point
    big = tm.decode_step_time(4096, 0)
    assert big == pytest.approx(2 * 7.62e9 * 4096 / (989e12 * 0.4), rel=1e-3)


def test_kv_concurrency_limit():
    tm = RooflineTimeModel(get_model("qwen2.5-1.5b"), get_hardware("h100"))
    n = tm.max_concurrency(1, 256 + 16384)
    budget = 80e9 * 0.9 - tm.model.weight_bytes
    assert n == int(budget // (tm.model.kv_bytes_per_token * (256 + 16384)))
    assert tm.max_concurrency(2, 256 + 16384) > 2 * n - 2
    capped = RooflineTimeModel(
        get_model("qwen2.5-1.5b"), get_hardware("h100"), max_batch_per_device=64
    )
    assert capped.max_concurrency(1, 1000) == 64
    with pytest.raises(ValueError, match="do not fit"):
        RooflineTimeModel(get_model("70b"), get_hardware("a100")).max_concurrency(1, 1000)
    with pytest.raises(ValueError):
        RooflineTimeModel(get_model("7b"), get_hardware("h100"), decode_efficiency=1.5)


@given(
    a=st.floats(1e-4, 1e-2),
    beta=st.floats(0, 1e-6),
    g=st.floats(0, 2e-2),
    n=st.integers(1, 64),
    c0=st.integers(0, 10_000),
    k=st.integers(0, 300),
)
def test_closed_form_steps_time_equals_sum(a, beta, g, n, c0, k):
    brute = sum(max(a + beta * (c0 + n * s), g) for s in range(k))
    assert steps_time(a, beta, g, n, c0, k) == pytest.approx(brute, rel=1e-9, abs=1e-12)
    budget = brute * 0.6
    j = steps_within(a, beta, g, n, c0, budget, k)
    assert steps_time(a, beta, g, n, c0, j) >= budget - 1e-15 or j == k
    if j > 0:
        assert steps_time(a, beta, g, n, c0, j - 1) < budget


def _profile() -> MeasuredProfile:
    return MeasuredProfile(
        model="tiny",
        params=1e5,
        device="cpu",
        threads=2,
        dtype="float32",
        decode_context=64,
        decode_step_s={1: 0.001, 4: 0.0012, 16: 0.002},
        decode_s_per_ctx_token=1e-7,
        prefill_tokens_per_s=2e5,
        train_tokens_per_s=2e4,
    )


def test_profiled_time_model(tmp_path):
    pr = _profile()
    pr.save(tmp_path / "p.json")
    again = MeasuredProfile.load(tmp_path / "p.json")
    assert again.decode_step_s == pr.decode_step_s
    tm = ProfiledTimeModel(again, concurrency=8)
    a, beta, g = tm.decode_step_params(4, 2)
    assert a + beta * 4 * 64 == pytest.approx(0.0012)  # measured point reproduced
    a8, b8, _ = tm.decode_step_params(8, 2)
    assert a8 + b8 * 8 * 64 == pytest.approx(0.0012 + (0.002 - 0.0012) * 4 / 12)
    a32, b32, _ = tm.decode_step_params(32, 2)
    assert a32 + b32 * 32 * 64 > 0.002  # extrapolated upwards
    # one of two threads: twice as slow
    assert tm.train_time(1000, 1) == pytest.approx(2 * tm.train_time(1000, 2))
    assert tm.prefill_time(2e5, 2) == pytest.approx(1.0)
    assert tm.max_concurrency(1, 10) == 8
    (tmp_path / "bad.json").write_text(json.dumps({"model": "x"}))
    with pytest.raises(ValueError, match="lacks"):
        MeasuredProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not found"):
        MeasuredProfile.load(tmp_path / "none.json")
    assert math.isfinite(tm.weight_bytes)


def test_profile_measured_at_other_thread_counts_is_used_as_measured(tmp_path):
    """CPU speed-ups are not linear in threads: with a measurement at 1 thread the model
    uses it (train 1.6x slower on 1 thread, a small decode step no slower) instead of 2x."""
    pr = _profile()
    pr.at_threads[1] = {
        "decode_step_s": {1: 0.001, 16: 0.003},
        "decode_s_per_ctx_token": 1e-7,
        "prefill_tokens_per_s": 1.2e5,
        "train_tokens_per_s": 1.25e4,
    }
    pr.save(tmp_path / "p.json")
    again = MeasuredProfile.load(tmp_path / "p.json")
    assert again.at_threads[1]["decode_step_s"] == {1: 0.001, 16: 0.003}
    tm = ProfiledTimeModel(again)
    assert tm.train_time(1.25e4, 1) == pytest.approx(1.0)  # measured, not 2 x 2e4 / 2e4
    assert tm.train_time(2e4, 2) == pytest.approx(1.0)  # the base measurement
    assert tm.prefill_time(1.2e5, 1) == pytest.approx(1.0)
    a, beta, _ = tm.decode_step_params(1, 1)
    assert a + beta * 64 == pytest.approx(0.001)  # not 2 x 0.001
    assert tm.train_time(2e4, 4) == pytest.approx(0.5)  # not measured at 4: scaled 2 / 4
    assert pr.with_threads(3) is None and pr.with_threads(2) is pr


def test_profiled_prefill_overhead(tmp_path):
    """An engine profile's prefill: overhead + tokens / rate per prefill, scaled like the
    rest; 0 tokens cost nothing; older profile files without the field still load."""
    pr = _profile()
    pr.prefill_overhead_s = 0.007
    pr.save(tmp_path / "p.json")
    tm = ProfiledTimeModel(MeasuredProfile.load(tmp_path / "p.json"))
    assert tm.prefill_time(2e5, 2) == pytest.approx(1.007)  # measured on 2 threads
    assert tm.prefill_time(1e5, 1) == pytest.approx(2 * (0.007 + 0.5))  # 1 of 2: twice
    assert tm.prefill_time(0, 2) == 0.0
    d = json.loads((tmp_path / "p.json").read_text())
    del d["prefill_overhead_s"]
    assert MeasuredProfile.from_dict(d).prefill_overhead_s == 0.0
    with pytest.raises(ValueError, match="prefill_overhead_s"):
        MeasuredProfile.from_dict({**d, "prefill_overhead_s": -1.0})

"""The two-phase training-memory model (relayrl.plan.memory): every term by hand on a tiny
shape, the fit recovers known coefficients, bad input, and the calibrated coefficients against
a real update's allocator peaks measured by ``bench/scale.py``'s measurement."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest

from helpers import load_bench
from relayrl.plan.memory import (
    CALIBRATED,
    CHUNKED_LOGIT_BYTES,
    MB,
    TrainMemoryModel,
    TrainShape,
    bench_shape,
    compare,
    fit,
)

M = TrainMemoryModel(a_fp32=10.0, a_bf16=6.0, k_ckpt=4.0, a0=3.0, v=8.0, overhead=100.0)
# N 1000, h 4, L 2, V 10, T 5, r 0.6: E = V h = 40, P_l = (1000 - 40) / 2 = 480, P_max = 40
BASE = dict(params=1000, trainable=1000, hidden=4, layers=2, vocab=10, tokens=5)


def shape(**kw) -> TrainShape:
    return TrainShape(**{**BASE, "response_share": 0.6, **kw})


def test_fp32_by_hand():
    s = shape()
    t = M.terms(s)
    # W 4N, G 4N, S 8N; A = T h (a L + a0) = 5*4*(10*2 + 3); X = T V 4 + v r T V = 200 + 8*0.6*50
    assert (t["W"], t["G"], t["S"], t["B16"]) == (4000, 4000, 8000, 0)
    assert t["A"] == 460 and t["X"] == pytest.approx(440)
    assert t["F"] == 0 and t["U"] == 8 * 40 and t["C"] == 100 and t["D"] == 16 * 40
    assert M.loss_bytes(s) == pytest.approx(16000 + 460 + 440 + 100)  # 17000
    assert M.embedding_bytes(s) == pytest.approx(16000 + 640 + 100)  # 16740
    assert M.backward_bytes(s) == pytest.approx(17000)
    assert M.optimizer_bytes(s) == pytest.approx(16000 + 320 + 100)  # 16420
    assert M.peak_bytes(s) == pytest.approx(17000)
    assert M.persistent_bytes(s) == pytest.approx(4000 + 8000 + 100)
    # no tokens: the loss point is 16100, the embedding's gradient (16740) sets the peak
    assert M.loss_bytes(shape(tokens=0)) == pytest.approx(16100)
    assert M.peak_bytes(shape(tokens=0)) == pytest.approx(16740)
    # no tokens under LoRA (D = 0): the optimizer step sets it
    lo = shape(tokens=0, trainable=50, lora=True, largest_trained=10)
    assert M.peak_bytes(lo) == M.optimizer_bytes(lo) == pytest.approx(4600 + 80 + 100)


def test_precision_checkpointing_lora_fsdp_by_hand():
    # bf16: B16 = 2N; A = 20 * (6 * 2 + 3) = 300; X = T V 2 + 240 = 340
    assert M.backward_bytes(shape(bf16=True)) == pytest.approx(16000 + 2000 + 300 + 340 + 100)
    # checkpointing: A = T h (k L + a0) = 20 * (8 + 3) = 220 (the embedding point: 16740)
    assert M.loss_bytes(shape(checkpointing=True)) == pytest.approx(16000 + 220 + 440 + 100)
    # both: B16 = 2 (E + P_l) = 1040; A = 220
    both = shape(bf16=True, checkpointing=True)
    assert M.backward_bytes(both) == pytest.approx(16000 + 1040 + 220 + 340 + 100)
    # LoRA, 50 trained, largest adapter 10: W 4000, G 200, S 400; U = 80
    lora = shape(trainable=50, lora=True, largest_trained=10)
    assert M.backward_bytes(lora) == pytest.approx(4600 + 460 + 440 + 100)
    assert M.optimizer_bytes(lora) == pytest.approx(4600 + 80 + 100)
    # FSDP2 over 4 ranks, foreach AdamW: W, G, S / 4; F = (2*4 + 4) P_l = 5760; U = 4N / 4
    sh = shape(dp=4, optimizer="foreach")
    assert M.backward_bytes(sh) == pytest.approx(4000 + 460 + 440 + 5760 + 100)
    assert M.optimizer_bytes(shape(dp=4)) == pytest.approx(4000 + 320 / 4 + 100)
    # ... and its embedding point: D = (16 + 4) E (the gathered fp32 root) = 800
    assert M.embedding_bytes(sh) == pytest.approx(4000 + 800 + 100)
    assert M.optimizer_bytes(sh) == pytest.approx(4000 + 1000 + 100)
    assert M.optimizer_bytes(shape(optimizer="fused")) == pytest.approx(16100)
    # tensor parallel: the embedding shard E given explicitly sets P_l and P_max
    tp = shape(embedding_params=20)
    assert tp.layer_params == 490 and M.terms(tp)["U"] == 160


def test_kept_logits_and_chunked_logprobs_by_hand():
    """The lm_head on a share k of the positions (``logits_to_keep``) and chunked logprobs:
    X = k T V b_c + x r T V, x = CHUNKED_LOGIT_BYTES instead of the fitted v."""
    x = CHUNKED_LOGIT_BYTES
    # T 5, V 10, r 0.6, k 0.4: K V 4 = 0.4 * 5 * 10 * 4 = 80; x r T V = 30 x
    s = shape(logits_kept=0.4, chunked_logprobs=True)
    assert M.terms(s)["X"] == pytest.approx(80 + 30 * x)
    assert M.loss_bytes(s) == pytest.approx(16000 + 460 + 80 + 30 * x + 100)
    # bf16: the head's output is bf16 (K V 2 = 40), the chunked buffers stay fp32
    assert M.terms(shape(logits_kept=0.4, chunked_logprobs=True, bf16=True))["X"] == (
        pytest.approx(40 + 30 * x)
    )
    # only the head kept: the fitted v on the whole-batch buffers (80 + 8 * 30)
    assert M.terms(shape(logits_kept=0.4))["X"] == pytest.approx(320)
    # SmolLM2-135M-Instruct, LoRA, a micro-batch of 16 rows of 64 prompt + 16 response
    # tokens: T = 1280, V = 49152, K = 16 * 17 = 272 positions, r T = 256 response tokens
    smol = TrainShape(
        params=139_399_488,
        trainable=4_884_480,
        hidden=576,
        layers=30,
        vocab=49152,
        tokens=1280,
        response_share=16 / 80,
        lora=True,
        logits_kept=17 / 80,
        chunked_logprobs=True,
    )
    assert CALIBRATED.terms(smol)["X"] == pytest.approx(272 * 49152 * 4 + x * 256 * 49152)
    # before logits_to_keep: every position's logits and the fitted whole-batch buffers
    old = TrainShape(**{**smol.__dict__, "logits_kept": 1.0, "chunked_logprobs": False})
    assert CALIBRATED.terms(old)["X"] == pytest.approx(
        1280 * 49152 * 4 + CALIBRATED.v * 256 * 49152
    )
    with pytest.raises(ValueError, match="logits_kept"):
        shape(logits_kept=0.0)


def test_fit_recovers_the_coefficients():
    pts = []
    for h, L, V, T, cfg in itertools.product(
        (64, 128), (2, 4), (100, 1000), (64, 256), ("fp32", "bf16", "fp32_ckpt", "lora")
    ):
        n = 12 * h * h * L + V * h
        s = TrainShape(
            params=n,
            trainable=n // 20 if cfg == "lora" else n,
            hidden=h,
            layers=L,
            vocab=V,
            tokens=T,
            response_share=0.75,
            bf16=cfg == "bf16",
            checkpointing=cfg == "fp32_ckpt",
            lora=cfg == "lora",
            largest_trained=h * 8 if cfg == "lora" else None,
        )
        pts.append((s, M.backward_bytes(s), M.optimizer_bytes(s)))
    got = fit(pts)
    for k, v in M.to_dict().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-6, abs=1e-6), k


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least two"):
        fit([(shape(), 1e5, 1e5)])
    with pytest.raises(ValueError, match="must be > 0"):
        fit([(shape(), 0.0, 1e5), (shape(), 1e5, 1e5)])
    with pytest.raises(ValueError, match="response_share"):
        shape(response_share=1.5)
    with pytest.raises(ValueError, match="optimizer"):
        shape(optimizer="sgd")
    with pytest.raises(ValueError, match="layers"):
        shape(layers=0)
    with pytest.raises(ValueError, match="unknown configuration 'fp8'"):
        bench_shape({"config": "fp8"})


def test_calibrated_coefficients_are_physical():
    """Activations halve-ish under bf16, checkpointing keeps far less per layer than the full
    activations, a few fp32 vocabulary buffers per response token, a small fixed overhead."""
    c = CALIBRATED
    assert c.a_fp32 > 0 and 0 < c.a_bf16 < c.a_fp32
    assert 0 < c.k_ckpt < c.a_fp32 / 4
    assert 4 <= c.v <= 64
    assert abs(c.overhead) < 64 * MB


def _bench():
    return load_bench("scale")


@pytest.mark.parametrize("config", ["fp32", "lora"])
def test_calibrated_model_predicts_a_real_update(tmp_path: Path, config: str):
    """An actor update of a small Llama (hidden 128, 2 layers, vocabulary 2048: a size the
    fit never saw) at 128 and 384 tokens: the allocator's peak of each phase, measured by
    ``bench/scale.py``'s profiler measurement, within 15% of the calibrated model."""
    bench = _bench()
    model, _ = bench.build_model(tmp_path / "m", 128, 2, 2048)
    args = argparse.Namespace(
        model=str(model), config=config, tokens_list=[128, 384], prompt=16, response=48, threads=1
    )
    rows = bench.measure_phases(args)
    for r in rows:
        r.update(hidden=128, layers=2, vocab=2048)
    assert [r["tokens"] for r in rows] == [128, 384]
    assert rows[1]["backward_mb"] > rows[0]["backward_mb"]  # activations grow with tokens
    for c in compare(CALIBRATED, rows):
        assert abs(c["error"]) < 0.15, c
        for phase in ("backward", "optimizer"):
            pred, meas = c[f"{phase}_pred_mb"], c[f"{phase}_mb"]
            assert abs(pred - meas) / meas < 0.15, (phase, c)

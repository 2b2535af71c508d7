"""The calibrated training-memory model (relayrl.plan.memory): formulas by hand, and the fit
recovers the constants of synthetic bench lines made from known ones."""

from __future__ import annotations

import pytest

from relayrl.plan.memory import CALIBRATED, MB, TrainMemoryModel, estimate_mb, fit

M = TrainMemoryModel(
    p_t=16.0,
    p_all=2.0,
    p_bf16=2.0,
    p_ckpt=-4.0,
    o_fsdp=0.25,
    a=100.0,
    d_bf16=-50.0,
    d_ckpt=-90.0,
    d_lora=20.0,
    d_fsdp=10.0,
)


def test_train_bytes_by_hand():
    # fp32: fixed (16 + 2) * 1000 = 18000; slope 100 * 8 * 2 = 1600 per token; 10 tokens
    assert M.train_bytes(1000, 1000, 8, 2, 10) == pytest.approx(18000 + 16000)
    # bf16 + checkpointing: fixed 18000 + 2000 - 4000 = 16000; slope 16 * (100 - 50 - 90) < 0
    got = M.train_bytes(1000, 1000, 8, 2, 10, bf16=True, checkpointing=True)
    assert got == pytest.approx(16000)  # the slope is clamped at 0
    # checkpointing alone: fixed 14000; slope 16 * (100 - 90) = 160 per token
    assert M.train_bytes(1000, 1000, 8, 2, 10, checkpointing=True) == pytest.approx(14000 + 1600)
    # LoRA, 50 trained: fixed 16 * 50 + 2 * 1000 = 2800; slope 16 * 120 = 1920
    assert M.train_bytes(1000, 50, 8, 2, 10, lora=True) == pytest.approx(2800 + 19200)
    # FSDP2 over 4 ranks: fixed 18000 * (1/4 + 0.25) = 9000; slope 16 * 110 = 1760
    assert M.train_bytes(1000, 1000, 8, 2, 10, fsdp_ranks=4) == pytest.approx(9000 + 17600)


def _bench_line(model: TrainMemoryModel, tokens: int) -> dict:
    n, n_lora, h, layers = 5e7, 2.5e6, 512, 16
    line: dict = {"params": n, "hidden": h, "layers": layers}
    for name in ("fp32", "bf16", "fp32_ckpt", "lora", "fsdp2_x2"):
        trainable = n_lora if name == "lora" else n
        mb = estimate_mb(model, name, n, trainable, h, layers, tokens)
        line[name] = {"train_peak_mb": mb, "trainable_params": trainable}
    return line


def test_fit_recovers_the_constants():
    got = fit(_bench_line(M, 256), _bench_line(M, 512), 256, 512)
    for k, v in M.to_dict().items():
        assert getattr(got, k) == pytest.approx(v, rel=1e-9, abs=1e-9), k


def test_fit_rejects_bad_input():
    line = _bench_line(M, 256)
    with pytest.raises(ValueError, match="must exceed"):
        fit(line, line, 256, 256)
    short = {k: v for k, v in line.items() if k != "lora"}
    with pytest.raises(ValueError, match="'lora' missing"):
        fit(short, line, 256, 512)


def test_calibrated_constants_are_physical():
    """The fit on the bench: at least the 12 bytes of gradient + Adam m, v per trained fp32
    parameter, and peaks that grow with the tokens where the backward sets them (LoRA,
    checkpointing); fp32's is set by the optimizer step (``a`` ~ 0 within noise)."""
    assert CALIBRATED.p_t >= 12.0
    assert CALIBRATED.a + CALIBRATED.d_lora > 0
    assert CALIBRATED.a + CALIBRATED.d_ckpt > 0
    assert abs(CALIBRATED.a) < 10
    est = CALIBRATED.train_bytes(5e7, 5e7, 512, 16, 256) / MB
    assert 500 < est < 2000

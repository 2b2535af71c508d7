"""Clipped value loss: hand-computed case."""

import pytest
import torch

from relayrl.algos import LossNorm, clipped_value_loss

D = torch.float64


def test_clipped_value_loss_hand_case() -> None:
    # clip c = 0.2, old = 0.5 everywhere -> clipped V lies in [0.3, 0.7]; 4th token masked.
    # t0: V=1.0, R=1: unclipped 0,    clipped (0.7-1)^2 = 0.09 -> 0.5*0.09 = 0.045 (clip active)
    # t1: V=0.6, R=0: unclipped 0.36, clipped the same        -> 0.18
    # t2: V=2.0, R=0: unclipped 4,    clipped 0.7^2 = 0.49     -> 2.0
    # token-mean: (0.045 + 0.18 + 2.0) / 3 = 2.225 / 3
    # grad dL/dV: t0 0 (the clipped branch wins and is flat in V); t1 (V-R)/3 = 0.2;
    # t2 (V-R)/3 = 2/3. Stats: vf_clipfrac 1/3, vpred_mean (1 + 0.6 + 2) / 3 = 1.2
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    values = torch.tensor([[1.0, 0.6, 2.0, float("nan")]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, float("inf")]], dtype=D)
    returns = torch.tensor([[1.0, 0.0, 0.0, 1e30]], dtype=D)
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, stats = clipped_value_loss(values, old, returns, mask, norm, clip_range=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(2.225 / 3)
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.2, 2 / 3, 0.0]], dtype=D))
    assert stats == pytest.approx({"vf_clipfrac": 1 / 3, "vpred_mean": 1.2})
    # no clipping: 0.5 * (0 + 0.36 + 4) / 3
    loss, stats = clipped_value_loss(values, old, returns, mask, norm, clip_range=None)
    assert loss.item() == pytest.approx(2.18 / 3)
    assert stats["vf_clipfrac"] == 0.0


def test_clipped_value_loss_empty_mask_and_bad_args() -> None:
    x = torch.ones(2, 2, dtype=D, requires_grad=True)
    mask = torch.zeros(2, 2)
    loss, stats = clipped_value_loss(x, x * 3, x * 5, mask, LossNorm.for_batch(mask, "token-mean"))
    assert loss.item() == 0.0 and stats == {"vf_clipfrac": 0.0, "vpred_mean": 0.0}
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(x, x, x, mask, LossNorm("token-mean", 1, 1), clip_range=-1.0)
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(x, x, torch.ones(2, 3), mask, LossNorm("token-mean", 1, 1))

"""Masked reductions, LossNorm and aggregate_loss: hand-computed cases."""

import math

import pytest
import torch

from relayrl.algos import (
    AGGREGATION_MODES,
    LossNorm,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

D = torch.float64


def test_masked_mean_hand_case_ignores_nan_in_holes() -> None:
    # row 0 keeps 1 and 3 (the hole holds NaN), row 1 is empty:
    # overall mean = (1 + 3) / 2 = 2; per row: [2, 0] (empty row -> 0, not NaN)
    x = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, 6.0]], dtype=D)
    m = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=D)
    assert masked_mean(x, m).item() == 2.0
    assert masked_mean(x, m, dim=-1).tolist() == [2.0, 0.0]
    assert masked_sum(x, m).item() == 4.0
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_masked_var_and_whiten_hand_case() -> None:
    # valid values 1, 2, 3 (100 is masked): mean 2, unbiased var = (1 + 0 + 1) / 2 = 1
    # whiten -> (x - 2) / sqrt(1 + eps) = [-1, 0, 1]; the masked slot -> 0
    x = torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=D)
    m = torch.tensor([[True, True, False, True]])
    assert masked_var(x, m).item() == pytest.approx(1.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    w = masked_whiten(x, m, eps=0.0)
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 0.0, 1.0]], dtype=D))
    # shift_mean=False adds the mean back: [1, 2, 0, 3]
    w2 = masked_whiten(x, m, shift_mean=False, eps=0.0)
    assert torch.allclose(w2, torch.tensor([[1.0, 2.0, 0.0, 3.0]], dtype=D))
    # a single valid value has variance 0 and whitens to 0 (no NaN)
    one = torch.tensor([[False, True, False, False]])
    assert masked_var(x, one).item() == 0.0
    assert torch.equal(masked_whiten(x, one), torch.zeros_like(x))


def test_loss_norm_for_batch_counts_tokens_and_rows() -> None:
    # 2 + 2 + 0 = 4 tokens; 3 rows (the empty row is still a sequence of the step)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    norm = LossNorm.for_batch(mask, "token-mean")
    assert (norm.global_tokens, norm.global_seqs, norm.norm_constant) == (4.0, 3.0, 1.0)
    # a list of micro-batch masks of different widths gives the same counts
    parts = [mask[:1, :2], mask[1:]]
    assert LossNorm.for_batch(parts, "token-mean") == norm
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        LossNorm("mean", 1.0, 1.0)
    with pytest.raises(ValueError, match="norm_constant"):
        LossNorm("seq-mean-token-sum-norm", 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="global_tokens"):
        LossNorm("token-mean", -1.0, 1.0)


def test_aggregate_loss_hand_case_every_mode() -> None:
    # loss [[1,2,3],[4,5,6],[7,8,9]]; mask keeps (0,0), (0,2), (1,1), (1,2); row 2 is empty.
    # row sums: 1+3 = 4, 5+6 = 11, 0; total 15; tokens 4; seqs 3; n_i = 2, 2, 0
    #  token-mean                 = 15 / 4                 = 3.75
    #  seq-mean-token-sum         = 15 / 3                 = 5
    #  seq-mean-token-mean        = (4/2 + 11/2 + 0) / 3   = 2.5   (empty row contributes 0)
    #  seq-mean-token-sum-norm(4) = 15 / (3 * 4)           = 1.25
    #  token-sum                  = 15                     (no normaliser)
    loss = torch.arange(1.0, 10.0, dtype=D).reshape(3, 3)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [0, 0, 0]], dtype=D)
    expected = {
        "token-mean": 3.75,
        "seq-mean-token-sum": 5.0,
        "seq-mean-token-mean": 2.5,
        "seq-mean-token-sum-norm": 1.25,
        "token-sum": 15.0,
    }
    assert set(expected) == set(AGGREGATION_MODES)
    for mode, value in expected.items():
        norm = LossNorm.for_batch(mask, mode, norm_constant=4.0)
        assert aggregate_loss(loss, mask, norm).item() == pytest.approx(value), mode
    # a step-global count larger than this micro-batch's is what divides: 15 / 6 = 2.5
    norm = LossNorm("seq-mean-token-sum", global_tokens=10.0, global_seqs=6.0)
    assert aggregate_loss(loss, mask, norm).item() == pytest.approx(2.5)
    # veRL's seq-mean denominator counts only non-empty rows: 15 / 2, (4/2 + 11/2) / 2
    for mode, value in (("seq-mean-token-sum", 7.5), ("seq-mean-token-mean", 3.75)):
        norm = LossNorm.for_batch(mask, mode, count_empty_rows=False)
        assert norm.global_seqs == 2.0
        assert aggregate_loss(loss, mask, norm).item() == pytest.approx(value), mode


def test_aggregate_loss_empty_mask_is_zero_not_nan() -> None:
    loss = torch.full((2, 3), float("inf"), dtype=D, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=D)
    for mode in AGGREGATION_MODES:
        out = aggregate_loss(loss, mask, LossNorm.for_batch(mask, mode))
        out.backward()
        assert out.item() == 0.0
        assert torch.equal(loss.grad, torch.zeros_like(loss))
        loss.grad = None
    assert not math.isnan(aggregate_loss(loss, mask, LossNorm("token-mean", 0.0, 0.0)).item())


def test_aggregate_loss_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="must both be"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 4), LossNorm("token-mean", 1.0, 1.0))

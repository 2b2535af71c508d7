"""Micro-batch invariance of the 2025 losses (GSPO, GSPO-token, CISPO, SAPO, GMPO), of
``token-sum``, of token weights (rollout correction) and of every behaviour-weight mode:
the gradient of a batch is the sum of its micro-batches' gradients, however it is split."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_algos_microbatch import Batch, make_batch, split_grad

from relayrl.algos import (
    AGGREGATION_MODES,
    BEHAV_WEIGHT_MODES,
    LossNorm,
    cispo_loss,
    decoupled_ppo_loss,
    gmpo_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    rollout_correction,
    sapo_loss,
)


def _weights(b: Batch) -> torch.Tensor:
    """Rollout-correction weights of the slice (row-wise, so any split gives the same)."""
    return rollout_correction(b["behav"] + 0.3 * b["adv"], b["behav"], b["mask"], "tis")[0]


LOSSES = {
    "gspo": lambda b, n: gspo_loss(b["x"], b["old"], b["adv"], b["mask"], n, 0.05, 0.05, 3.0)[0],
    "gspo_token": lambda b, n: gspo_token_loss(b["x"], b["old"], b["adv"], b["mask"], n, 0.05)[0],
    "cispo": lambda b, n: cispo_loss(b["x"], b["old"], b["adv"], b["mask"], n)[0],
    "sapo": lambda b, n: sapo_loss(b["x"], b["old"], b["adv"], b["mask"], n)[0],
    "gmpo": lambda b, n: gmpo_loss(b["x"], b["old"], b["adv"], b["mask"], n, 0.2, 0.2)[0],
    "ppo_tis": lambda b, n: ppo_clip_loss(
        b["x"], b["old"], b["adv"], b["mask"], n, token_weights=_weights(b)
    )[0],
    "gmpo_tis": lambda b, n: gmpo_loss(
        b["x"], b["old"], b["adv"], b["mask"], n, token_weights=_weights(b)
    )[0],
    **{
        f"decoupled_{mode}": (
            lambda b, n, mode=mode: decoupled_ppo_loss(
                b["x"],
                b["old"],
                b["behav"],
                b["adv"],
                b["mask"],
                n,
                behav_weight_mode=mode,
                behav_weight_cap=4.0,
            )[0]
        )  # fmt: skip
        for mode in BEHAV_WEIGHT_MODES
    },
}


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_gradient_is_the_sum_over_1_to_4_micro_batches(mode: str, loss_name: str) -> None:
    batch = make_batch(0)
    norm = LossNorm.for_batch(batch["mask"], mode, norm_constant=9.0)
    rows = torch.arange(batch["mask"].shape[0])
    full_loss, full_grad = split_grad(LOSSES[loss_name], batch, norm, [rows])
    assert full_grad.abs().sum() > 0
    for k in (2, 3, 4):
        loss, grad = split_grad(LOSSES[loss_name], batch, norm, list(rows.tensor_split(k)))
        assert loss == pytest.approx(full_loss, abs=1e-9)
        torch.testing.assert_close(grad, full_grad, atol=1e-9, rtol=0)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(AGGREGATION_MODES),
    st.sampled_from(sorted(LOSSES)),
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_gradient_is_invariant_to_shuffled_uneven_splits(
    seed: int, mode: str, loss_name: str, cuts: list[int]
) -> None:
    batch = make_batch(seed)
    norm = LossNorm.for_batch(batch["mask"], mode, norm_constant=9.0)
    b = batch["mask"].shape[0]
    _, full_grad = split_grad(LOSSES[loss_name], batch, norm, [torch.arange(b)])
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    parts = [p for p in perm.tensor_split(sorted(set(cuts) - {b})) if len(p)]
    _, grad = split_grad(LOSSES[loss_name], batch, norm, parts)
    torch.testing.assert_close(grad, full_grad, atol=1e-9, rtol=0)

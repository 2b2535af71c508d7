"""Micro-batch invariance: with a step-global LossNorm, the gradient of a batch equals the sum
of the gradients of its micro-batches, however it is split (1, 2, 3, 4 micro-batches,
uneven sizes, shuffled rows, each micro-batch padded only to its own length). For PPO clip,
decoupled PPO, the value loss and KL; the 2025 losses (GSPO, GSPO-token, CISPO, SAPO, GMPO);
token weights (rollout correction); and every behaviour-weight mode."""

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    AGGREGATION_MODES,
    BEHAV_WEIGHT_MODES,
    LossNorm,
    aggregate_loss,
    cispo_loss,
    clipped_value_loss,
    decoupled_ppo_loss,
    gmpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_penalty,
    ppo_clip_loss,
    rollout_correction,
    sapo_loss,
)

D = torch.float64
Batch = dict[str, torch.Tensor]

# Each loss: (batch slice, norm) -> scalar. The differentiable input is batch["x"]
# (logprobs for the policy / KL losses, values for the value loss).
LOSSES: dict[str, Callable[[Batch, LossNorm], torch.Tensor]] = {
    "ppo": lambda b, n: ppo_clip_loss(b["x"], b["old"], b["adv"], b["mask"], n, dual_clip=3.0)[0],
    "decoupled_ppo": lambda b, n: decoupled_ppo_loss(
        b["x"], b["old"], b["behav"], b["adv"], b["mask"], n, dual_clip=3.0
    )[0],
    "value": lambda b, n: clipped_value_loss(b["x"], b["old"], b["adv"], b["mask"], n)[0],
    "kl_k3": lambda b, n: aggregate_loss(
        kl_penalty(b["x"], b["old"], "k3", b["mask"]), b["mask"], n
    ),
}


def _weights(b: Batch) -> torch.Tensor:
    """Rollout-correction weights of the slice (row-wise, so any split gives the same)."""
    return rollout_correction(b["behav"] + 0.3 * b["adv"], b["behav"], b["mask"], "tis")[0]


# The 2025 losses, token weights and the behaviour-weight modes.
LOSSES |= {
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


def make_batch(seed: int, b: int = 7, t: int = 9) -> Batch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.7  # holes everywhere
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask &= torch.arange(t) < lengths[:, None]  # ragged right padding, some rows empty
    old = -torch.rand(b, t, generator=g, dtype=D) * 3
    return {
        "mask": mask,
        "old": old,
        "x": old + (torch.rand(b, t, generator=g, dtype=D) - 0.5),  # ratios in [0.6, 1.65]
        "behav": old - torch.rand(b, t, generator=g, dtype=D) * 2.5,  # weights 1..12, some capped
        "adv": torch.randn(b, t, generator=g, dtype=D),
    }


def split_grad(
    loss_fn: Callable[[Batch, LossNorm], torch.Tensor], batch: Batch, norm: LossNorm,
    row_groups: list[torch.Tensor],
) -> tuple[float, torch.Tensor]:  # fmt: skip
    """Accumulate loss and gradient over micro-batches, each trimmed to its own last token."""
    x = batch["x"].clone().requires_grad_(True)
    total = 0.0
    for rows in row_groups:
        valid_cols = batch["mask"][rows].any(0).nonzero()
        width = int(valid_cols.max()) + 1 if len(valid_cols) else 1
        part = {k: v[rows][:, :width] for k, v in batch.items() if k != "x"}
        part["x"] = x[rows][:, :width]
        loss = loss_fn(part, norm)
        loss.backward()
        total += loss.item()
    return total, x.grad


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_gradient_is_the_sum_over_1_to_4_micro_batches(mode: str, loss_name: str) -> None:
    for seed in (0, 1):
        batch = make_batch(seed)
        norm = LossNorm.for_batch(batch["mask"], mode, norm_constant=9.0)
        rows = torch.arange(batch["mask"].shape[0])
        full_loss, full_grad = split_grad(LOSSES[loss_name], batch, norm, [rows])
        assert full_grad.abs().sum() > 0
        for k in (1, 2, 3, 4):
            loss, grad = split_grad(LOSSES[loss_name], batch, norm, list(rows.tensor_split(k)))
            assert loss == pytest.approx(full_loss, abs=1e-9)
            torch.testing.assert_close(grad, full_grad, atol=1e-9, rtol=0)


@settings(max_examples=50, deadline=None)  # 25 each when the 2025 losses had their own file
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
    rows = torch.arange(b)
    _, full_grad = split_grad(LOSSES[loss_name], batch, norm, [rows])
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    bounds = sorted(set(cuts) - {b})
    parts = [p for p in perm.tensor_split(bounds) if len(p)]
    _, grad = split_grad(LOSSES[loss_name], batch, norm, parts)
    torch.testing.assert_close(grad, full_grad, atol=1e-9, rtol=0)


def test_a_per_micro_batch_norm_would_not_be_invariant() -> None:
    # The bug this design prevents: normalising each micro-batch by its own token count.
    batch = make_batch(0)
    rows = torch.arange(7)
    full = LossNorm.for_batch(batch["mask"], "token-mean")
    _, full_grad = split_grad(LOSSES["ppo"], batch, full, [rows])
    x = batch["x"].clone().requires_grad_(True)
    for part_rows in rows.tensor_split(2):
        part = {k: v[part_rows] for k, v in batch.items() if k != "x"}
        part["x"] = x[part_rows]
        local = LossNorm.for_batch(part["mask"], "token-mean")
        LOSSES["ppo"](part, local).backward()
    assert not torch.allclose(x.grad, full_grad, atol=1e-6)

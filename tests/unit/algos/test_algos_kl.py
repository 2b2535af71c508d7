"""KL estimators, KL-shaped rewards and KL coefficient controllers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
)

D = torch.float64


def test_kl_penalty_hand_case() -> None:
    # d = logp - ref = [0, -1, 2, -20]; x = ref - logp = -d = [0, 1, -2, 20]
    # k1 = d; k2 = d^2/2 = [0, .5, 2, 200]; abs = [0, 1, 2, 20]
    # k3 = e^x - x - 1 = [0, e - 2, e^-2 + 1, e^20 - 21 -> clamped to 10]
    logp = torch.tensor([[-1.0, -2.0, 0.5, -25.0]], dtype=D)
    ref = torch.tensor([[-1.0, -1.0, -1.5, -5.0]], dtype=D)
    assert kl_penalty(logp, ref, "k1").tolist() == [[0.0, -1.0, 2.0, -20.0]]
    assert kl_penalty(logp, ref, "k2").tolist() == [[0.0, 0.5, 2.0, 200.0]]
    assert kl_penalty(logp, ref, "abs").tolist() == [[0.0, 1.0, 2.0, 20.0]]
    k3 = kl_penalty(logp, ref, "k3")
    assert k3[0].tolist() == pytest.approx([0.0, math.e - 2, math.exp(-2) + 1, 10.0])
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")
    # with a mask the output is exactly 0 on masked tokens, whatever they hold
    mask = torch.tensor([[1, 1, 0, 1]])
    bad = ref.clone()
    bad[0, 2] = float("nan")
    masked = kl_penalty(logp, bad, "k3", response_mask=mask)
    assert masked[0, 2].item() == 0.0 and torch.equal(masked[0, [0, 1, 3]], k3[0, [0, 1, 3]])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-30, 5, allow_nan=False), min_size=1, max_size=12),
    st.lists(st.floats(-30, 5, allow_nan=False), min_size=1, max_size=12),
)
def test_k3_is_nonnegative_and_zero_iff_equal(a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    logp = torch.tensor(a[:n], dtype=D)
    ref = torch.tensor(b[:n] + a[:n], dtype=D)[: 2 * n].reshape(2, n)  # row 1: ref == logp
    k3 = kl_penalty(logp.expand(2, n), ref, "k3")
    assert (k3 >= 0).all()
    assert torch.equal(k3[1], torch.zeros(n, dtype=D))
    # distinct inputs give a strictly positive estimate (away from float64 resolution)
    distinct = (logp - ref[0]).abs() > 1e-6
    assert (k3[0][distinct] > 0).all()


def test_apply_kl_to_rewards_hand_case() -> None:
    # beta 0.5, k1 KL per token: row 0 [.1 .2 (masked)], row 1 [.3 (hole) .4], row 2 empty.
    # rewards = -0.5 * KL; the score lands on the LAST valid token:
    # row 0: [-.05, -.1 + 1, 0]   (last valid index 1, not the padded end)
    # row 1: [-.15, 0, -.2 + 2]   (the hole gets nothing)
    # row 2: nothing valid -> its score 7 is dropped
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]], dtype=D)
    ref = torch.zeros(3, 3, dtype=D)
    logp = torch.tensor([[0.1, 0.2, 9.0], [0.3, float("nan"), 0.4], [1.0, 1.0, 1.0]], dtype=D)
    scores = torch.tensor([1.0, 2.0, 7.0], dtype=D)
    rewards, kl = apply_kl_to_rewards(scores, logp, ref, mask, beta=0.5)
    expected = torch.tensor([[-0.05, 0.9, 0.0], [-0.15, 0.0, 1.8], [0.0, 0.0, 0.0]], dtype=D)
    assert torch.allclose(rewards, expected)
    assert torch.allclose(kl, torch.tensor([[0.1, 0.2, 0], [0.3, 0, 0.4], [0, 0, 0]], dtype=D))
    # k2 variant: -0.5 * d^2 / 2 on row 0 token 0 = -0.0025
    rewards2, _ = apply_kl_to_rewards(scores, logp, ref, mask, beta=0.5, kind="k2")
    assert rewards2[0, 0].item() == pytest.approx(-0.0025)
    with pytest.raises(ValueError, match="scores must be"):
        apply_kl_to_rewards(scores[:2], logp, ref, mask, beta=0.5)


def test_kl_controllers_hand_case() -> None:
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=64)
    assert fixed.value == 0.05
    # init 0.1, target 6, horizon 10000:
    # kl 12 -> err = clip(12/6 - 1, -.2, .2) = .2 -> 0.1 * (1 + .2 * 256/10000) = 0.100512
    # kl 6  -> err 0 -> unchanged;  kl 0 -> err -.2 -> * (1 - .2 * 100/10000) = * 0.998
    ctl = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    ctl.update(12.0, 256)
    assert ctl.value == pytest.approx(0.100512)
    ctl.update(6.0, 256)
    assert ctl.value == pytest.approx(0.100512)
    ctl.update(0.0, 100)
    assert ctl.value == pytest.approx(0.100512 * 0.998)
    assert KL_CONTROLLERS == {"fixed": FixedKLController, "adaptive": AdaptiveKLController}
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)

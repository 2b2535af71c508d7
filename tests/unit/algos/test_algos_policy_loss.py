"""PPO clip, dual clip and the decoupled (AReaL) objective."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    LossNorm,
    PolicyLossInputs,
    decoupled_ppo_loss,
    get_policy_loss,
    ppo_clip_loss,
)
from relayrl.config import AlgoConfig

D = torch.float64
PROPS = settings(max_examples=40, deadline=None)
NAN, INF = float("nan"), float("inf")


def _leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D, requires_grad=True)


def test_registry() -> None:
    weighted = {"gspo", "gspo_token", "cispo", "sapo", "gmpo"}
    assert {"ppo", "decoupled_ppo"} | weighted <= set(POLICY_LOSSES)  # tests may add their own
    assert POLICY_LOSSES["ppo"].off_policy == "behaviour"  # naive PPO off the sync schedule
    assert POLICY_LOSSES["decoupled_ppo"].off_policy == "in_loss"
    assert all(POLICY_LOSSES[n].off_policy == "weight" for n in weighted)
    with pytest.raises(ValueError, match="unknown algo.policy_loss 'nope'; registered: cispo"):
        get_policy_loss("nope")


def test_registered_losses_are_the_functions_with_the_run_settings() -> None:
    """The registry's one signature (inputs, algo) gives what the loss function gives with the
    algo section's clip range and its own knobs."""
    g = torch.Generator().manual_seed(0)
    shape = (3, 5)
    logp = torch.randn(shape, generator=g, dtype=D) - 1
    old = logp + 0.3 * torch.randn(shape, generator=g, dtype=D)
    behav = old + 0.3 * torch.randn(shape, generator=g, dtype=D)
    adv = torch.randn(shape, generator=g, dtype=D)
    mask = torch.ones(shape, dtype=D)
    mask[2, 3:] = 0
    norm = LossNorm.for_batch(mask, "token-mean")
    algo = AlgoConfig(clip_eps_low=0.1, clip_eps_high=0.3, behav_weight_cap=1.5)
    x = PolicyLossInputs(logp, old, behav, adv, mask, norm)
    common = dict(advantages=adv, response_mask=mask, norm=norm, eps_low=0.1, eps_high=0.3)
    loss, _ = POLICY_LOSSES["ppo"](x, algo)
    assert float(loss) == float(ppo_clip_loss(logp, old, **common)[0])
    loss, _ = POLICY_LOSSES["decoupled_ppo"](x, algo)
    expected = decoupled_ppo_loss(logp, old, behav, behav_weight_cap=1.5, **common)[0]
    assert float(loss) == float(expected)


def test_ppo_clip_hand_case() -> None:
    # old = -1 everywhere; log-ratios [0, ln 1.5, ln 0.5, ln 4]; A = [2, 1, -1, -1]; eps 0.2.
    # The 5th token is masked and holds garbage (NaN logprob, inf advantage).
    # t0: r=1,   A=2:  pg = -2                       grad d pg/d logp = -A r = -2
    # t1: r=1.5, A=1:  max(-1.5, -1.2) = -1.2        clipped (upper), grad 0
    # t2: r=0.5, A=-1: max(0.5, 0.8) = 0.8           clipped (lower), grad 0
    # t3: r=4,   A=-1: max(4, 1.2) = 4               grad -A r = 4
    # token-mean over 4 tokens: (-2 - 1.2 + 0.8 + 4) / 4 = 0.4; grads / 4
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=D)
    old = torch.tensor([[-1.0, -1, -1, -1, -1]], dtype=D)
    shift = [0.0, math.log(1.5), math.log(0.5), math.log(4.0)]
    logp = _leaf([[-1.0 + s for s in shift] + [NAN]])
    adv = torch.tensor([[2.0, 1, -1, -1, INF]], dtype=D)
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, stats = ppo_clip_loss(logp, old, adv, mask, norm)
    loss.backward()
    assert loss.item() == pytest.approx(0.4)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 0, 0, 1, 0]], dtype=D))
    assert stats == pytest.approx(
        {
            "clipfrac_upper": 0.25,
            "clipfrac_lower": 0.25,
            "clipfrac": 0.5,
            "dual_clipfrac": 0.0,
            "approx_kl": -math.log(3.0) / 4,  # mean(old - new) = -(ln 1.5 + ln .5 + ln 4)/4
            "ratio_mean": 1.75,  # (1 + 1.5 + 0.5 + 4) / 4
            "behav_weight_mean": 1.0,
            "behav_weight_max": 1.0,
            "capped_frac": 0.0,
        }
    )
    # dual clip c = 3: t3 becomes min(4, -A c = 3) = 3 with grad 0 -> (-2-1.2+0.8+3)/4 = 0.15
    logp.grad = None
    loss, stats = ppo_clip_loss(logp, old, adv, mask, norm, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.15)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 0, 0, 0, 0]], dtype=D))
    assert stats["dual_clipfrac"] == 0.25
    # clip-higher (DAPO) eps_high = 0.6: t1 (r = 1.5 < 1.6) is not clipped any more:
    # (-2 - 1.5 + 0.8 + 4) / 4 = 0.325, its grad -A r / 4 = -0.375
    logp.grad = None
    loss, stats = ppo_clip_loss(logp, old, adv, mask, norm, eps_high=0.6)
    loss.backward()
    assert loss.item() == pytest.approx(0.325)
    assert logp.grad[0, 1].item() == pytest.approx(-0.375)
    assert stats["clipfrac_upper"] == 0.0


def test_decoupled_hand_case() -> None:
    # prox = -1; w = exp(prox - behav) = [2, 8, 0.5]; ratio = exp(logp - prox) = [1, 1, 1.5];
    # A = 1; cap 5; 4th token masked (garbage). Token losses:
    # t0: w=2,  pg = -1              -> -2      grad w * (-A r) = -2
    # t1: w=8 > cap                  ->  0      grad 0, but still counted in the denominator
    # t2: w=.5, pg = max(-1.5, -1.2) -> -0.6    grad 0 (clipped)
    # token-mean over 3 tokens: -2.6 / 3
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    prox = torch.tensor([[-1.0, -1, -1, NAN]], dtype=D)
    behav = torch.tensor([[-1 - math.log(2), -1 - math.log(8), -1 - math.log(0.5), INF]], dtype=D)
    logp = _leaf([[-1.0, -1, -1 + math.log(1.5), 3.0]])
    adv = torch.tensor([[1.0, 1, 1, NAN]], dtype=D)
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, norm)
    loss.backward()
    assert loss.item() == pytest.approx(-2.6 / 3)
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, 0, 0, 0]], dtype=D))
    assert stats["behav_weight_mean"] == pytest.approx(3.5)  # (2 + 8 + 0.5) / 3
    assert stats["behav_weight_max"] == pytest.approx(8.0)
    assert stats["capped_frac"] == pytest.approx(1 / 3)
    assert stats["clipfrac_upper"] == pytest.approx(1 / 3)
    assert stats["approx_kl"] == pytest.approx(-math.log(1.5) / 3)  # mean(prox - logp)
    # no weight (cap kept): (-1 + 0 - 1.2) / 3
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, norm, apply_behav_weight=False)
    assert loss.item() == pytest.approx(-2.2 / 3)
    # no cap: t1 contributes 8 * -1 -> (-2 - 8 - 0.6) / 3
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, norm, behav_weight_cap=None)
    assert loss.item() == pytest.approx(-10.6 / 3)
    assert stats["capped_frac"] == 0.0


def test_empty_mask_gives_zero_loss_and_zero_stats() -> None:
    mask = torch.zeros(2, 3, dtype=D)
    logp = torch.randn(2, 3, dtype=D, requires_grad=True)
    other = torch.randn(2, 3, dtype=D)
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    for loss, stats in (
        ppo_clip_loss(logp, other, other, mask, norm, dual_clip=3.0),
        decoupled_ppo_loss(logp, other, other - 5, other, mask, norm),
    ):
        loss.backward()
        assert loss.item() == 0.0
        assert all(v == 0.0 for v in stats.values()), stats
        assert torch.equal(logp.grad, torch.zeros_like(logp))
        logp.grad = None


def test_bad_clip_parameters_raise() -> None:
    x = torch.zeros(1, 2)
    norm = LossNorm("token-mean", 2.0, 1.0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(x, x, x, torch.ones(1, 2), norm, dual_clip=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(x, x, x, torch.ones(1, 2), norm, eps_low=1.5)
    with pytest.raises(ValueError, match="behav_weight_cap"):
        decoupled_ppo_loss(x, x, x, x, torch.ones(1, 2), norm, behav_weight_cap=0.0)
    with pytest.raises(ValueError, match="!= response_mask"):
        ppo_clip_loss(x, x, torch.zeros(1, 3), torch.ones(1, 2), norm)


@st.composite
def ppo_batches(draw: st.DrawFn) -> dict:
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t)))
    old = -torch.rand(b, t, generator=g, dtype=D) * 3
    return {
        "mask": mask.reshape(b, t),
        "old": old,
        "logp": old + (torch.rand(b, t, generator=g, dtype=D) * 2 - 1),  # ratio in [e^-1, e]
        "adv": torch.randn(b, t, generator=g, dtype=D),
        "eps_low": draw(st.sampled_from([0.1, 0.2, 0.3])),
        "eps_high": draw(st.sampled_from([0.2, 0.28, 0.5])),
        "dual_clip": draw(st.sampled_from([None, 1.5, 3.0])),
        "mode": draw(st.sampled_from(AGGREGATION_MODES)),
    }


@PROPS
@given(ppo_batches())
def test_ppo_gradient_is_zero_beyond_the_clip(case: dict) -> None:
    mask, old, adv = case["mask"], case["old"], case["adv"]
    logp = case["logp"].clone().requires_grad_(True)
    el, eh = case["eps_low"], case["eps_high"]
    norm = LossNorm.for_batch(mask, case["mode"], norm_constant=7.0)
    loss, _ = ppo_clip_loss(logp, old, adv, mask, norm, el, eh, case["dual_clip"])
    loss.backward()
    ratio = torch.exp(logp.detach() - old)
    margin = 1e-6  # stay off the kinks, where the derivative is one-sided
    beyond = mask & (
        ((adv > 0) & (ratio > 1 + eh + margin)) | ((adv < 0) & (ratio < 1 - el - margin))
    )
    assert torch.equal(logp.grad[beyond], torch.zeros_like(logp.grad[beyond]))
    # inside the clip range the token gets the plain policy-gradient: -A * ratio / its norm
    inside = mask & ((ratio - 1).abs() < min(el, eh) - margin)
    assert (logp.grad[inside] * adv[inside] <= 0).all()
    assert (logp.grad[inside & (adv != 0)] != 0).all()


@PROPS
@given(ppo_batches(), st.sampled_from([None, 1.0, 5.0]), st.booleans())
def test_decoupled_with_prox_equal_behav_is_plain_ppo(
    case: dict, cap: float | None, apply_weight: bool
) -> None:
    mask, old, adv = case["mask"], case["old"], case["adv"]
    norm = LossNorm.for_batch(mask, case["mode"], norm_constant=7.0)
    clip = (case["eps_low"], case["eps_high"], case["dual_clip"])
    logp_a = case["logp"].clone().requires_grad_(True)
    logp_b = case["logp"].clone().requires_grad_(True)
    loss_a, stats_a = ppo_clip_loss(logp_a, old, adv, mask, norm, *clip)
    loss_b, stats_b = decoupled_ppo_loss(
        logp_b, old, old.clone(), adv, mask, norm, *clip,
        behav_weight_cap=cap, apply_behav_weight=apply_weight,
    )  # fmt: skip
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(logp_a.grad, logp_b.grad)
    assert stats_a == stats_b

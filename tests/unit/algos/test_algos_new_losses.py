"""GSPO, GSPO-token, GMPO, CISPO and SAPO: hand-computed cases, properties, and agreement with
independent re-implementations of the reference formulas (veRL ``core_algos``, written here
the way veRL writes them: veRL forces ``seq-mean-token-mean`` for GSPO / SAPO and takes a row
mean for GMPO, so the comparisons use that aggregation)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    AGGREGATION_MODES,
    LossNorm,
    cispo_loss,
    gmpo_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_clip_loss,
    sapo_loss,
)

D = torch.float64
PROPS = settings(max_examples=30, deadline=None)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().to(D).requires_grad_(True)


def _loss_and_grad(fn, logp: torch.Tensor, *args, **kwargs):
    x = _leaf(logp)
    loss, stats = fn(x, *args, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, stats


def _batch(seed: int, b: int = 5, t: int = 6, per_seq_adv: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t) < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=D) * 3
    logp = old + (torch.rand(b, t, generator=g, dtype=D) - 0.5) * 0.8
    adv = torch.randn(b, 1 if per_seq_adv else t, generator=g, dtype=D).expand(b, t).clone()
    return {"mask": mask, "old": old, "logp": logp, "adv": adv}


# --- reference formulas (veRL core_algos semantics, re-derived independently) -------------


def _ref_seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(loss_mat.dtype)
    per_seq = (loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.sum() / mask.shape[0]


def ref_gspo(logp, old, adv, mask, lo, hi):
    m = mask.to(D)
    neg_kl = logp - old
    seq = (neg_kl * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + seq.detach()[:, None]
    s = torch.exp(log_s.clamp(max=10.0))
    pg = torch.maximum(-adv * s, -adv * s.clamp(1 - lo, 1 + hi))
    return _ref_seq_mean_token_mean(pg, mask)


def ref_sapo(logp, old, adv, mask, tau_pos, tau_neg):
    r = torch.exp((logp - old).clamp(-20, 20))
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=D), torch.tensor(tau_neg, dtype=D))
    gate = torch.sigmoid(tau * (r - 1)) * (4 / tau)
    return _ref_seq_mean_token_mean(-gate * adv, mask)


def ref_gmpo(logp, old, adv, mask, lo, hi):
    m = mask.to(D)
    neg_kl = logp - old
    sgn = torch.sign(adv)
    clamped = neg_kl.clamp(-lo, hi)
    chosen = sgn * torch.min(sgn * neg_kl, sgn * clamped)
    n = m.sum(-1)
    ratio = torch.exp((chosen * m).sum(-1) / (n + 1e-8))
    a = (adv * m).sum(-1) / (n + 1e-8)
    return torch.mean(-a * ratio)


def ref_cispo(logp, old, adv, mask, lo, hi):
    m = mask.to(D)
    r = torch.exp((logp - old).clamp(-20, 20))
    w = r.clamp(1 - lo, 1 + hi).detach()
    return ((-w * adv * logp) * m).sum() / m.sum()


# --- GSPO --------------------------------------------------------------------------------


def test_gspo_hand_case() -> None:
    # row 0: log-ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 > 1.2, A = 1: loss -1.2, clipped, grad 0
    # row 1: log-ratios [0, -0.1, 0.1] -> s = 1, A = -1: loss 1, d/dlogp_t (-A s) = 1/3
    # seq-mean-token-mean: (-1.2 + 1) / 2 = -0.1; row-1 grads (1/3) / 2 = 1/6
    # token-mean: (2 * -1.2 + 3 * 1) / 5 = 0.12; row-1 grads: 3 tokens * (1/3) / 5 = 1/5
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old = torch.full((2, 3), -1.0, dtype=D)
    logp = old + torch.tensor([[0.1, 0.3, float("nan")], [0.0, -0.1, 0.1]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=D)
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    loss, grad, stats = _loss_and_grad(gspo_loss, logp, old, adv, mask, norm, 0.2, 0.2)
    assert loss.item() == pytest.approx(-0.1)
    expected = torch.tensor([[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]], dtype=D)
    torch.testing.assert_close(grad, expected)
    assert stats["clipfrac_upper"] == pytest.approx(2 / 5)
    assert stats["clipfrac_lower"] == 0.0
    assert stats["ratio_mean"] == pytest.approx((2 * math.exp(0.2) + 3) / 5)
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, grad, _ = _loss_and_grad(gspo_loss, logp, old, adv, mask, norm, 0.2, 0.2)
    assert loss.item() == pytest.approx(0.12)
    torch.testing.assert_close(grad, torch.tensor([[0, 0, 0], [0.2, 0.2, 0.2]], dtype=D))


@st.composite
def one_token_rows(draw: st.DrawFn) -> dict:
    b = draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(b, 1, generator=g, dtype=D) * 3
    return {
        "mask": torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))[:, None],
        "old": old,
        "logp": old + (torch.rand(b, 1, generator=g, dtype=D) * 2 - 1),
        "adv": torch.randn(b, 1, generator=g, dtype=D),
        "clip": (draw(st.sampled_from([0.1, 0.2])), draw(st.sampled_from([0.2, 0.28]))),
        "dual": draw(st.sampled_from([None, 3.0])),
        "mode": draw(st.sampled_from(AGGREGATION_MODES)),
    }


@PROPS
@given(one_token_rows())
def test_gspo_with_one_token_sequences_is_ppo_clip(case: dict) -> None:
    mask, old, adv = case["mask"], case["old"], case["adv"]
    norm = LossNorm.for_batch(mask, case["mode"], norm_constant=3.0)
    args = (old, adv, mask, norm, *case["clip"], case["dual"])
    ppo_loss, ppo_grad, ppo_stats = _loss_and_grad(ppo_clip_loss, case["logp"], *args)
    for fn in (gspo_loss, gspo_token_loss):
        loss, grad, stats = _loss_and_grad(fn, case["logp"], *args)
        torch.testing.assert_close(loss, ppo_loss)
        torch.testing.assert_close(grad, ppo_grad)
        assert stats == pytest.approx(ppo_stats)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_matches_the_reference_formula(seed: int) -> None:
    case = _batch(seed, per_seq_adv=False)  # token-varying advantages
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    loss, grad, _ = _loss_and_grad(
        gspo_token_loss, case["logp"], case["old"], case["adv"], mask, norm, 3e-2, 4e-2
    )
    x = _leaf(case["logp"])
    ref = ref_gspo(x, case["old"], case["adv"], mask, 3e-2, 4e-2)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad * mask, x.grad * mask)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_gspo_token_with_one_advantage_per_sequence(seed: int) -> None:
    case = _batch(seed)
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    args = (case["old"], case["adv"], mask, norm, 0.05, 0.05)
    loss_a, grad_a, _ = _loss_and_grad(gspo_loss, case["logp"], *args)
    loss_b, grad_b, _ = _loss_and_grad(gspo_token_loss, case["logp"], *args)
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(grad_a, grad_b)


# --- GMPO --------------------------------------------------------------------------------


def test_gmpo_hand_case() -> None:
    # eps 0.4 in log space. row 0, A = 1: log-ratios [0.5, -0.1] -> [0.4 (clipped), -0.1],
    #   ratio e^0.15, loss -e^0.15; grad: token 0 clipped -> 0, token 1: -e^0.15 / 2 (mean).
    # row 1, A = -1: log-ratio [-0.6] -> -0.4 (clipped below), loss +e^-0.4, grad 0.
    # seq-mean-token-mean over 2 rows: (-e^0.15 + e^-0.4) / 2; grads halved.
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    old = torch.full((2, 2), -2.0, dtype=D)
    logp = old + torch.tensor([[0.5, -0.1], [-0.6, 0.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=D)
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    loss, grad, stats = _loss_and_grad(gmpo_loss, logp, old, adv, mask, norm, 0.4, 0.4)
    assert loss.item() == pytest.approx((-math.exp(0.15) + math.exp(-0.4)) / 2)
    expected = torch.tensor([[0.0, -math.exp(0.15) / 4], [0.0, 0.0]], dtype=D)
    torch.testing.assert_close(grad, expected)
    assert stats["clipfrac_upper"] == pytest.approx(1 / 3)
    assert stats["clipfrac_lower"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError) as err:
        gmpo_loss(logp, old, adv, mask, norm, dual_clip=3.0)
    assert str(err.value) == "dual_clip is not defined for the gmpo loss (set algo.dual_clip: null)"


@pytest.mark.parametrize("seed", range(4))
def test_gmpo_matches_the_reference_formula(seed: int) -> None:
    case = _batch(seed)
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    loss, grad, _ = _loss_and_grad(
        gmpo_loss, case["logp"], case["old"], case["adv"], mask, norm, 0.1, 0.15
    )
    x = _leaf(case["logp"])
    ref = ref_gmpo(x, case["old"], case["adv"], mask, 0.1, 0.15)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad * mask, x.grad * mask)


# --- CISPO -------------------------------------------------------------------------------


def test_cispo_hand_case() -> None:
    # ratios [1.5, 1.0, 0.5], A [1, 1, -1], eps 0.2: weights sg(clip) = [1.2, 1.0, 0.8].
    # loss_t = -w A logp; logp = old + log r with old = -1:
    #   t0: -1.2 * (-1 + ln 1.5); t1: -1 * (-1); t2: +0.8 * (-1 + ln 0.5); token-mean over 3.
    # grad_t = -w A / 3 = [-0.4, -1/3, 0.8/3]: no token loses its gradient.
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.full((1, 3), -1.0, dtype=D)
    logp = old + torch.log(torch.tensor([[1.5, 1.0, 0.5]], dtype=D))
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=D)
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, grad, stats = _loss_and_grad(cispo_loss, logp, old, adv, mask, norm, 0.2, 0.2)
    values = [-1.2 * (-1 + math.log(1.5)), 1.0, 0.8 * (-1 + math.log(0.5))]
    assert loss.item() == pytest.approx(sum(values) / 3)
    torch.testing.assert_close(grad, torch.tensor([[-0.4, -1 / 3, 0.8 / 3]], dtype=D))
    assert (stats["clipfrac_upper"], stats["clipfrac_lower"]) == pytest.approx((1 / 3, 1 / 3))


@pytest.mark.parametrize("seed", range(4))
def test_cispo_matches_the_reference_formula(seed: int) -> None:
    case = _batch(seed, per_seq_adv=False)
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "token-mean")
    loss, grad, _ = _loss_and_grad(
        cispo_loss, case["logp"], case["old"], case["adv"], mask, norm, 0.1, 0.2
    )
    x = _leaf(case["logp"])
    ref = ref_cispo(x, case["old"], case["adv"], mask, 0.1, 0.2)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad * mask, x.grad * mask)


# --- SAPO --------------------------------------------------------------------------------


def test_sapo_hand_case_is_the_policy_gradient_on_policy() -> None:
    # r = 1: gate = sigmoid(0) * 4 / tau = 2 / tau, loss_t = -2 A / tau; d gate / d logp =
    # 4 sigma (1 - sigma) r = 1, so grad_t = -A / N exactly as REINFORCE on policy.
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, 0.0]], dtype=D)
    adv = torch.tensor([[2.0, -1.0, 5.0]], dtype=D)
    norm = LossNorm.for_batch(mask, "token-mean")
    taus = {"tau_pos": 1.0, "tau_neg": 2.0}
    loss, grad, stats = _loss_and_grad(sapo_loss, old, old, adv, mask, norm, **taus)
    assert loss.item() == pytest.approx((-2 * 2 / 1.0 + 2 * 1 / 2.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5, 0.0]], dtype=D))
    assert stats["gate_mean"] == pytest.approx((2.0 + 1.0) / 2)
    # far off policy the gradient decays smoothly instead of dropping to 0 at a clip edge
    far = old + torch.tensor([[3.0, 0.0, 0.0]], dtype=D)
    _, grad_far, _ = _loss_and_grad(sapo_loss, far, old, adv, mask, norm)
    assert 0 < -grad_far[0, 0].item() < 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_sapo_matches_the_reference_formula(seed: int) -> None:
    case = _batch(seed, per_seq_adv=False)
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "seq-mean-token-mean")
    loss, grad, _ = _loss_and_grad(
        sapo_loss, case["logp"], case["old"], case["adv"], mask, norm, tau_pos=1.0, tau_neg=1.05
    )
    x = _leaf(case["logp"])
    ref = ref_sapo(x, case["old"], case["adv"], mask, 1.0, 1.05)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad * mask, x.grad * mask)


def test_losses_without_dual_clip_say_so() -> None:
    x = torch.zeros(1, 2, dtype=D)
    norm = LossNorm("token-mean", 2.0, 1.0)
    for name, fn in (("cispo", cispo_loss), ("sapo", sapo_loss)):
        with pytest.raises(ValueError) as err:
            fn(x, x, x, torch.ones(1, 2), norm, dual_clip=2.0)
        assert str(err.value) == (
            f"dual_clip is not defined for the {name} loss (set algo.dual_clip: null)"
        )


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss, gmpo_loss, cispo_loss, sapo_loss])
def test_empty_mask_and_garbage_in_holes(fn) -> None:
    mask = torch.tensor([[1, 0], [0, 0]], dtype=torch.bool)
    nan = float("nan")
    logp = _leaf(torch.tensor([[-1.0, nan], [nan, nan]], dtype=D))
    other = torch.tensor([[-1.2, float("inf")], [nan, -float("inf")]], dtype=D)
    loss, stats = fn(logp, other, torch.tensor([[1.0, nan], [nan, nan]], dtype=D), mask,
                     LossNorm.for_batch(mask, "token-mean"))  # fmt: skip
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()
    assert all(math.isfinite(v) for v in stats.values())
    empty = torch.zeros(2, 2, dtype=torch.bool)
    loss, stats = fn(logp, other, other, empty, LossNorm.for_batch(empty, "token-mean"))
    assert loss.item() == 0.0 and all(v == 0.0 for v in stats.values())


@pytest.mark.parametrize("fn", [gspo_loss, gspo_token_loss, cispo_loss, sapo_loss, gmpo_loss])
def test_token_weights_scale_the_token_terms(fn) -> None:
    case = _batch(7)
    mask = case["mask"]
    norm = LossNorm.for_batch(mask, "token-sum")
    args = (case["old"], case["adv"], mask, norm)
    eps = dict(eps_low=0.3, eps_high=0.3)
    ones = torch.ones_like(case["old"])
    base, base_grad, _ = _loss_and_grad(fn, case["logp"], *args, **eps)
    same, same_grad, _ = _loss_and_grad(fn, case["logp"], *args, **eps, token_weights=ones)
    torch.testing.assert_close(base, same)
    torch.testing.assert_close(base_grad, same_grad)
    zero, zero_grad, _ = _loss_and_grad(fn, case["logp"], *args, **eps, token_weights=0 * ones)
    assert zero.item() == 0.0 and (zero_grad == 0).all()
    twice, twice_grad, _ = _loss_and_grad(fn, case["logp"], *args, **eps, token_weights=2 * ones)
    torch.testing.assert_close(twice, 2 * base)
    torch.testing.assert_close(twice_grad, 2 * base_grad)

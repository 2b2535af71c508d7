"""Rollout correction (TIS / MIS / IcePop, batch normalisation, KL rejection), its mismatch
stats, and the behaviour-weight modes of decoupled PPO."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    BEHAV_WEIGHT_MODES,
    LossNorm,
    behaviour_weights,
    decoupled_ppo_loss,
    ppo_clip_loss,
    rollout_correction,
)

D = torch.float64
PROPS = settings(max_examples=30, deadline=None)
LN = math.log


def _rows(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, engine) logprobs with trainer / engine = the given ratios."""
    engine = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=D)
    return engine + torch.log(torch.tensor(ratios, dtype=D)), engine


def test_tis_token_and_sequence_hand_case() -> None:
    # token ratios [[3, 0.5, 1], [1.5, 1, (masked 9)]], cap 2:
    # token TIS: [[2, 0.5, 1], [1.5, 1, 0]], one of 5 tokens truncated
    # sequence TIS: products 1.5 and 1.5 (masked token excluded) -> all weights 1.5, none capped
    trainer, engine = _rows([[3.0, 0.5, 1.0], [1.5, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, stats = rollout_correction(trainer, engine, mask, "tis", "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]], dtype=D))
    assert stats["rollout_corr/affected_frac"] == pytest.approx(1 / 5)
    assert stats["rollout_corr/weight_max"] == pytest.approx(2.0)
    assert stats["rollout_corr/logp_diff_abs_max"] == pytest.approx(LN(3.0))
    assert stats["rollout_corr/beyond_threshold_frac"] == pytest.approx(3 / 5)
    assert stats["rollout_corr/ratio_frac_ge_2"] == pytest.approx(1 / 5)
    assert stats["rollout_corr/ratio_frac_0.95_1.05"] == pytest.approx(2 / 5)
    w, stats = rollout_correction(trainer, engine, mask, "tis", "sequence", cap=2.0)
    torch.testing.assert_close(w, 1.5 * mask.to(D))
    assert stats["rollout_corr/affected_frac"] == 0.0
    w, stats = rollout_correction(trainer, engine, mask, "tis", "sequence", cap=1.2)
    torch.testing.assert_close(w, 1.2 * mask.to(D))
    assert stats["rollout_corr/affected_frac"] == 1.0


def test_mis_drops_tokens_or_sequences_outside_the_band() -> None:
    # band [0.5, 2]: token MIS keeps the ratio inside and zeroes 3 and 0.25
    # sequence MIS: row 0 product 0.75 kept (all tokens weight 0.75), row 1 product 3 dropped
    trainer, engine = _rows([[3.0, 0.25, 1.0], [1.5, 2.0, 1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, stats = rollout_correction(trainer, engine, mask, "mis", "token", lower=0.5, upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0, 0, 1.0], [1.5, 2.0, 1.0]], dtype=D))
    assert stats["rollout_corr/affected_frac"] == pytest.approx(2 / 6)
    w, stats = rollout_correction(trainer, engine, mask, "mis", "sequence", lower=0.5, upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.75] * 3, [0.0] * 3], dtype=D))
    assert stats["rollout_corr/affected_frac"] == pytest.approx(0.5)


@st.composite
def mismatched(draw: st.DrawFn) -> dict:
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    engine = -torch.rand(b, t, generator=g, dtype=D) * 4
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t)))
    return {
        "engine": engine,
        "trainer": engine + torch.randn(b, t, generator=g, dtype=D),  # ratios e^N(0, 1)
        "mask": mask.reshape(b, t),
        "level": draw(st.sampled_from(["token", "sequence"])),
    }


@PROPS
@given(mismatched())
def test_infinite_cap_and_infinite_band_are_plain_importance_sampling(case: dict) -> None:
    # TIS with no cap and MIS with no band correct nothing away: the weight is rho itself
    # (the plain importance weight, token or sequence), no token is affected.
    trainer, engine, mask, level = case["trainer"], case["engine"], case["mask"], case["level"]
    plain, _ = rollout_correction(trainer, engine, mask, "tis", level, cap=None)
    log_rho = torch.where(mask, trainer - engine, 0)
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.where(mask, torch.exp(log_rho.clamp(-20, 20)), 0)
    torch.testing.assert_close(plain, rho)
    for mode, kwargs in (
        ("tis", {"cap": 1e300}),
        ("mis", {"lower": None, "upper": None}),
        ("mis", {"lower": 1e-300, "upper": 1e300}),
    ):
        w, stats = rollout_correction(trainer, engine, mask, mode, level, **kwargs)
        assert torch.equal(w, plain), (mode, kwargs)
        assert stats["rollout_corr/affected_frac"] == 0.0


@PROPS
@given(mismatched(), st.sampled_from(["none", "tis", "mis", "icepop"]), st.booleans())
def test_no_mismatch_means_no_correction(case: dict, mode: str, normalise: bool) -> None:
    # engine == trainer: every mode gives weight 1 on valid tokens and the corrected PPO loss
    # is the uncorrected one, value and gradient.
    engine, mask = case["engine"], case["mask"]
    level = "token" if mode == "icepop" else case["level"]
    w, stats = rollout_correction(engine, engine.clone(), mask, mode, level,
                                  batch_normalize=normalise, reject_kl=0.5)  # fmt: skip
    assert torch.equal(w, mask.to(D))
    assert stats["rollout_corr/affected_frac"] == 0.0
    assert stats["rollout_corr/logp_diff_abs_max"] == 0.0
    logp = engine + 0.1
    norm = LossNorm.for_batch(mask, "token-mean")
    adv = torch.ones_like(engine)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    la, _ = ppo_clip_loss(a, engine, adv, mask, norm)
    lb, _ = ppo_clip_loss(b, engine, adv, mask, norm, token_weights=w)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)


@PROPS
@given(mismatched(), st.sampled_from([(0.5, 2.0), (0.8, 1.25), (0.5, 5.0)]))
def test_icepop_masks_exactly_the_tokens_outside_the_band(case: dict, band) -> None:
    trainer, engine, mask = case["trainer"], case["engine"], case["mask"]
    lo, hi = band
    w, stats = rollout_correction(trainer, engine, mask, "icepop", lower=lo, upper=hi)
    rho = torch.exp(trainer - engine)
    outside = mask & ((rho < lo) | (rho > hi))
    inside = mask & ~outside
    assert (w[outside] == 0).all()
    torch.testing.assert_close(w[inside], rho[inside])
    assert (w[~mask] == 0).all()
    n = int(mask.sum())
    assert stats["rollout_corr/affected_frac"] == pytest.approx(int(outside.sum()) / max(n, 1))


def test_icepop_is_token_level_and_bands_are_checked() -> None:
    x = torch.zeros(1, 2, dtype=D)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError) as err:
        rollout_correction(x, x, m, "icepop", "sequence")
    assert str(err.value) == "icepop masks tokens: it needs level 'token'"
    with pytest.raises(ValueError) as err:
        rollout_correction(x, x, m, "mis", lower=2.0, upper=0.5)
    assert str(err.value) == "need 0 < lower < upper, got lower=2.0, upper=0.5"
    with pytest.raises(ValueError) as err:
        rollout_correction(x, x, m, "cap")
    assert str(err.value) == (
        "unknown rollout correction mode 'cap'; known: ['none', 'tis', 'mis', 'icepop']"
    )


def test_batch_normalised_weights_have_mean_one() -> None:
    trainer, engine = _rows([[3.0, 0.5, 1.0], [1.5, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w, stats = rollout_correction(trainer, engine, mask, "tis", cap=2.0, batch_normalize=True)
    raw = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.0, 0.0]], dtype=D)
    torch.testing.assert_close(w, raw / 1.2)  # mean of the 5 kept weights = 6 / 5
    assert stats["rollout_corr/batch_norm_factor"] == pytest.approx(1.2)
    assert w[mask].mean().item() == pytest.approx(1.0)
    # sequence level: one weight per sequence (1.5 and 1.5 -> factor 1.5)
    w, stats = rollout_correction(trainer, engine, mask, "tis", "sequence", cap=None,
                                  batch_normalize=True)  # fmt: skip
    torch.testing.assert_close(w, mask.to(D))
    assert stats["rollout_corr/batch_norm_factor"] == pytest.approx(1.5)


def test_rejection_by_sequence_kl() -> None:
    # row 0 log-ratios [ln 3, 0]: k1 = -log rho = [-ln 3, 0], mean -0.549; k3 = rho - 1 - ln rho
    #   = [2 - ln 3, 0] -> mean 0.451, sum 0.901, max 0.901
    # row 1 log-ratios [ln 1.1, ln 0.9]: k3 = [0.00469, 0.00536] -> mean 0.00502
    trainer, engine = _rows([[3.0, 1.0], [1.1, 0.9]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    for agg, threshold in (("mean", 0.3), ("sum", 0.8), ("max", 0.8)):
        w, stats = rollout_correction(trainer, engine, mask, "none", reject_kl=threshold,
                                      kl_agg=agg)  # fmt: skip
        torch.testing.assert_close(w, torch.tensor([[0, 0], [1.0, 1.0]], dtype=D))
        assert stats["rollout_corr/rejected_frac"] == 0.5
        assert stats["rollout_corr/rejected_seq_frac"] == 0.5
    w, _ = rollout_correction(trainer, engine, mask, "none", reject_kl=0.5, kl_agg="mean")
    assert (w == 1).all()  # 0.451 < 0.5 keeps row 0
    # k1 of row 0 is negative (the engine under-rates the token): nothing to reject
    w, _ = rollout_correction(trainer, engine, mask, "none", reject_kl=0.01, kl_estimator="k1")
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=D))
    # composable: TIS weights on the kept sequence
    w, _ = rollout_correction(trainer, engine, mask, "tis", cap=2.0, reject_kl=0.3)
    torch.testing.assert_close(w, torch.tensor([[0, 0], [1.1, 0.9]], dtype=D))


# --- behaviour-weight modes of decoupled PPO -------------------------------------------------


def test_behaviour_weight_modes_hand_case() -> None:
    # w = prox / behav = [[8, 0.1, 1], [2, 2, (masked)]]; cap 5 (lower 1/5 = 0.2 for clamp)
    prox = torch.full((2, 3), -1.0, dtype=D)
    behav = prox - torch.log(torch.tensor([[8.0, 0.1, 1.0], [2.0, 2.0, 1e6]], dtype=D))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    expect = {
        "token-mask": [[0, 0.1, 1], [2, 2, 0]],
        "token-truncate": [[5, 0.1, 1], [2, 2, 0]],
        "token-clamp": [[5, 0.2, 1], [2, 2, 0]],
        # geometric means: row 0 (8 * 0.1 * 1)^(1/3) = 0.928, row 1 (2 * 2)^(1/2) = 2
        "sequence-mask": [[0.8 ** (1 / 3)] * 3, [2, 2, 0]],
        "sequence-truncate": [[0.8 ** (1 / 3)] * 3, [2, 2, 0]],
        "sequence-clamp": [[0.8 ** (1 / 3)] * 3, [2, 2, 0]],
    }
    affected = {"token-mask": 0.2, "token-truncate": 0.2, "token-clamp": 0.4}
    assert set(expect) == set(BEHAV_WEIGHT_MODES)
    for mode, rows in expect.items():
        factor, w, hit = behaviour_weights(prox, behav, mask, mode, cap=5.0)
        torch.testing.assert_close(factor, torch.tensor(rows, dtype=D), msg=mode)
        assert hit.sum().item() / 5 == pytest.approx(affected.get(mode, 0.0)), mode
    factor, _, _ = behaviour_weights(prox, behav, mask, "sequence-mask", cap=1.5)
    torch.testing.assert_close(factor, torch.tensor([[0.8 ** (1 / 3)] * 3, [0, 0, 0]], dtype=D))
    factor, _, _ = behaviour_weights(prox, behav, mask, "token-clamp", cap=5.0, lower=0.5)
    torch.testing.assert_close(factor, torch.tensor([[5, 0.5, 1], [2, 2, 0]], dtype=D))
    with pytest.raises(ValueError) as err:
        behaviour_weights(prox, behav, mask, "clip")
    assert str(err.value).startswith("unknown behav_weight_mode 'clip'; known: ['token-mask'")


def test_decoupled_loss_uses_the_mode_and_token_mask_is_the_old_default() -> None:
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(4, 5, generator=g, dtype=D) * 2
    behav = prox - torch.randn(4, 5, generator=g, dtype=D)
    adv = torch.randn(4, 5, generator=g, dtype=D)
    mask = torch.rand(4, 5, generator=g) < 0.8
    norm = LossNorm.for_batch(mask, "token-mean")
    logp = prox + 0.05
    default, s0 = decoupled_ppo_loss(logp, prox, behav, adv, mask, norm)
    masked, s1 = decoupled_ppo_loss(logp, prox, behav, adv, mask, norm,
                                    behav_weight_mode="token-mask")  # fmt: skip
    assert torch.equal(default, masked) and s0 == s1
    # truncate: every token keeps a weight <= cap, none is zeroed
    x = logp.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(x, prox, behav, adv, mask, norm, behav_weight_cap=1.5,
                                     behav_weight_mode="token-truncate")  # fmt: skip
    loss.backward()
    w = torch.exp(prox - behav).clamp(max=1.5)
    ref_pg, _ = ppo_clip_loss(logp, prox, adv, mask, norm, token_weights=w)
    torch.testing.assert_close(loss, ref_pg)
    assert stats["capped_frac"] == pytest.approx(
        (mask & (torch.exp(prox - behav) > 1.5)).sum().item() / mask.sum().item()
    )

"""The Tinker built-in losses (relayrl.tinker.losses) against hand-computed values.

One datum of two tokens: trainer logprobs lp = (-0.5, -1.0), sampling logprobs q = (-0.7,
-0.6), advantages A = (2, -1), so r = exp(lp - q) = (e^0.2, e^-0.4) = (1.221403, 0.670320).
"""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.tinker.losses import BUILTIN_LOSSES, LossInputError, check_loss, datum_loss

LP = [-0.5, -1.0]
INPUTS = {
    "target_tokens": torch.tensor([3, 4]),
    "logprobs": torch.tensor([-0.7, -0.6]),
    "advantages": torch.tensor([2.0, -1.0]),
    "weights": torch.tensor([1.0, 0.5]),
}
R1, R2 = math.exp(0.2), math.exp(-0.4)


def _inputs(name: str, **override: torch.Tensor) -> dict[str, torch.Tensor]:
    """INPUTS (with overrides) restricted to the keys ``name`` reads."""
    return {k: v for k, v in {**INPUTS, **override}.items() if k in BUILTIN_LOSSES[name]}


def _loss(name: str, **config: float) -> tuple[float, list[float]]:
    lp = torch.tensor(LP, requires_grad=True)
    loss = datum_loss(name, lp, _inputs(name), check_loss(name, config))
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), lp.grad.tolist()


def test_cross_entropy_is_the_weighted_negative_logprob_sum() -> None:
    # -(1 * -0.5 + 0.5 * -1.0) = 1.0; d/dlp = -w
    loss, grad = _loss("cross_entropy")
    assert loss == pytest.approx(1.0)
    assert grad == pytest.approx([-1.0, -0.5])


def test_importance_sampling_is_minus_ratio_times_advantage() -> None:
    # -(2 r1 - r2) = -(2.442806 - 0.670320) = -1.772485; d/dlp = -r A
    loss, grad = _loss("importance_sampling")
    assert loss == pytest.approx(-(2 * R1 - R2), abs=1e-6)
    assert loss == pytest.approx(-1.772485, abs=1e-6)
    assert grad == pytest.approx([-2 * R1, R2], abs=1e-6)


def test_ppo_clips_both_tokens_at_the_default_thresholds() -> None:
    # token 1: min(2 r1 = 2.4428, 2 * 1.2 = 2.4) = 2.4; token 2: min(-r2 = -0.6703, -0.8) = -0.8
    # loss = -(2.4 - 0.8) = -1.6; both clipped branches are chosen: no gradient
    loss, grad = _loss("ppo")
    assert loss == pytest.approx(-1.6, abs=1e-6)
    assert grad == pytest.approx([0.0, 0.0])


def test_ppo_with_wide_thresholds_is_importance_sampling() -> None:
    loss, grad = _loss("ppo", clip_low_threshold=0.5, clip_high_threshold=1.5)
    assert loss == pytest.approx(-(2 * R1 - R2), abs=1e-6)
    assert grad == pytest.approx([-2 * R1, R2], abs=1e-6)


def test_cispo_weights_the_logprob_by_the_clipped_ratio() -> None:
    # w = (clip(1.2214) = 1.2, clip(0.6703) = 0.8); loss = -(1.2 * -0.5 * 2 + 0.8 * -1 * -1)
    # = -(-1.2 + 0.8) = 0.4; d/dlp = -w A = (-2.4, 0.8)
    loss, grad = _loss("cispo")
    assert loss == pytest.approx(0.4, abs=1e-6)
    assert grad == pytest.approx([-2.4, 0.8], abs=1e-6)


def test_dro_is_the_advantage_objective_minus_a_quadratic_penalty() -> None:
    # beta = 0.1: lp A - 0.05 (lp - q)^2 = (-1 - 0.002) + (1 - 0.008) = -0.01; loss = 0.01
    # d/dlp = -(A - 0.1 (lp - q)) = (-(2 - 0.02), -(-1 + 0.04)) = (-1.98, 0.96)
    loss, grad = _loss("dro", beta=0.1)
    assert loss == pytest.approx(0.01, abs=1e-6)
    assert grad == pytest.approx([-1.98, 0.96], abs=1e-6)


def test_bad_requests_are_loss_input_errors() -> None:
    with pytest.raises(LossInputError, match="not supported"):
        check_loss("gspo", None)
    with pytest.raises(LossInputError, match="not a parameter"):
        check_loss("ppo", {"beta": 1.0})
    with pytest.raises(LossInputError, match="clip_low_threshold"):
        check_loss("ppo", {"clip_low_threshold": 1.2})
    short = _inputs("importance_sampling", advantages=torch.tensor([1.0]))
    with pytest.raises(LossInputError, match=r"advantages.*shape \[1\]"):
        datum_loss("importance_sampling", torch.tensor(LP), short, check_loss("ppo", None))
    missing = {"target_tokens": INPUTS["target_tokens"]}
    with pytest.raises(LossInputError, match="advantages|logprobs"):
        datum_loss("dro", torch.tensor(LP), missing, check_loss("dro", None))


def test_non_finite_inputs_are_refused() -> None:
    lp = torch.tensor(LP)
    bad = _inputs("ppo", advantages=torch.tensor([float("nan"), 1.0]))
    with pytest.raises(LossInputError, match="advantages.*non-finite"):
        datum_loss("ppo", lp, bad, check_loss("ppo", None))
    inf_w = _inputs("cross_entropy", weights=torch.tensor([1.0, float("inf")]))
    with pytest.raises(LossInputError, match="weights.*non-finite"):
        datum_loss("cross_entropy", lp, inf_w, check_loss("cross_entropy", None))


def test_inputs_a_loss_does_not_read_are_refused() -> None:
    """A per-token clip threshold (or ``weights`` for a policy loss) used to be ignored."""
    lp = torch.tensor(LP)
    clip = {**_inputs("ppo"), "clip_low_threshold": torch.tensor([0.99, 0.99])}
    with pytest.raises(LossInputError, match=r"clip_low_threshold.*loss_fn_config"):
        datum_loss("ppo", lp, clip, check_loss("ppo", None))
    with pytest.raises(LossInputError, match=r"does not read.*\['weights'\]"):
        datum_loss("importance_sampling", lp, {**_inputs("ppo"), "weights": INPUTS["weights"]},
                   check_loss("importance_sampling", None))  # fmt: skip


def test_top_k_cross_entropy_sums_every_candidate() -> None:
    """[N, K] = [2, 2] targets: lp = ((-0.5, -2.0), (-1.0, -3.0)), w = ((0.75, 0.25),
    (1.0, 0.0)): loss = 0.375 + 0.5 + 1.0 + 0 = 1.875; d/dlp = -w."""
    lp = torch.tensor([[-0.5, -2.0], [-1.0, -3.0]], requires_grad=True)
    w = torch.tensor([[0.75, 0.25], [1.0, 0.0]])
    inputs = {"target_tokens": torch.tensor([[3, 7], [4, 8]]), "weights": w}
    loss = datum_loss("cross_entropy", lp, inputs, check_loss("cross_entropy", None))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.875)
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, -w)
    with pytest.raises(LossInputError, match=r"weights.*shape \[2\]"):
        datum_loss("cross_entropy", lp, {**inputs, "weights": torch.ones(2)}, {})
    with pytest.raises(LossInputError, match="1-D target_tokens"):
        datum_loss("ppo", lp, {"target_tokens": inputs["target_tokens"], "logprobs": lp,
                               "advantages": lp}, check_loss("ppo", None))  # fmt: skip

"""The points where relayrl's convention differs from veRL's, each with veRL's as an option:
singleton groups, the REINFORCE++-baseline target, the KL fed to the adaptive controller and
the seq-mean denominator with empty rows (values checked against veRL's formulas)."""

import pytest
import torch

from relayrl.algos import (
    LossNorm,
    aggregate_loss,
    compute_drgrpo,
    compute_grpo,
    compute_reinforce_plus_plus_baseline,
    masked_whiten,
)
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import _estimator_kwargs, kl_for_controller

D = torch.float64


def _outcome(scores: list[float], lengths: list[int], t: int = 3) -> tuple[torch.Tensor, ...]:
    mask = torch.arange(t) < torch.tensor(lengths)[:, None]
    rewards = torch.zeros(len(scores), t, dtype=D)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = s
    return rewards, mask


def test_singleton_group_zero_or_raw_score() -> None:
    # groups: {0, 1} with scores 1, 0 and the singleton {2} with score 0.5
    rewards, mask = _outcome([1.0, 0.0, 0.5], [2, 3, 1])
    group = torch.tensor([0, 0, 1])
    ours, _ = compute_grpo(rewards, mask, group)
    verl, _ = compute_grpo(rewards, mask, group, singleton="score")
    std = torch.tensor([1.0, 0.0]).std().item()  # unbiased: 0.7071
    assert ours[2, 0].item() == 0.0
    assert verl[2, 0].item() == pytest.approx(0.5 / (1 + 1e-6))  # (0.5 - 0) / (1 + eps)
    torch.testing.assert_close(ours[:2], verl[:2])
    assert ours[0, 0].item() == pytest.approx(0.5 / (std + 1e-6))
    dr, _ = compute_drgrpo(rewards, mask, group, singleton="score")
    assert dr[2, 0].item() == 0.5 and dr[0, 0].item() == 0.5
    with pytest.raises(ValueError) as err:
        compute_grpo(rewards, mask, group, singleton="nan")
    assert str(err.value) == "unknown singleton convention 'nan'; known: ['zero', 'score']"


def test_reinforce_pp_baseline_targets() -> None:
    # two groups of two, gamma 0.5, score on the last token: return-to-go differs per token
    rewards, mask = _outcome([1.0, 0.0, 2.0, 1.0], [3, 3, 2, 1])
    group = torch.tensor([0, 0, 1, 1])
    ours, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, gamma=0.5)
    verl, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, 0.5, target="score")
    # veRL: s_i = the discounted return at the first token; (s_i - group mean) on every token
    s = torch.tensor([0.25, 0.0, 1.0, 1.0], dtype=D)
    centred = s - torch.tensor([0.125, 0.125, 1.0, 1.0], dtype=D)
    expected = masked_whiten(centred[:, None].expand(4, 3) * mask, mask)
    torch.testing.assert_close(verl, expected)
    assert not torch.allclose(ours, verl)
    # gamma = 1, outcome reward only: both definitions agree
    a, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, gamma=1.0)
    b, _ = compute_reinforce_plus_plus_baseline(rewards, mask, group, 1.0, target="score")
    torch.testing.assert_close(a, b)


def test_kl_for_the_adaptive_controller() -> None:
    # row 0: KL [1, 1, 1]; row 1: KL [4, -, -]: token mean 7 / 4, mean of row means 2.5
    kl = torch.tensor([[1.0, 1.0, 1.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert kl_for_controller(kl, mask, "token-mean") == pytest.approx(1.75)
    assert kl_for_controller(kl, mask, "seq-mean") == pytest.approx(2.5)


def test_seq_mean_with_empty_rows_counted_or_not() -> None:
    loss = torch.ones(3, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    ours = aggregate_loss(loss, mask, LossNorm.for_batch(mask, "seq-mean-token-mean"))
    verl = aggregate_loss(
        loss, mask, LossNorm.for_batch(mask, "seq-mean-token-mean", count_empty_rows=False)
    )
    assert (ours.item(), verl.item()) == pytest.approx((2 / 3, 1.0))


def test_config_options_reach_the_estimators() -> None:
    cfg = load_config(RunConfig, None, ["algo.singleton_advantage=score"])
    assert _estimator_kwargs(cfg) == {"norm_by_std": True, "singleton": "score"}
    cfg = load_config(
        RunConfig,
        None,
        ["algo.advantage=reinforce_plus_plus_baseline", "algo.rfpp_baseline_target=score"],
    )
    assert _estimator_kwargs(cfg) == {"gamma": 1.0, "target": "score", "singleton": "zero"}

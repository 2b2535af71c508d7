"""Advantage estimators: hand-computed cases, group conventions, properties, dispatch."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_drgrpo,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    discounted_returns,
    masked_whiten,
)

D = torch.float64
PROPS = settings(max_examples=40, deadline=None)


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


# ---------------------------------------------------------------- GAE


def test_gae_hand_case() -> None:
    # gamma = lam = 0.5, r = [1, 0, 2], V = [0.5, 1, 0.25]
    # t=2: delta = 2 + 0 - 0.25 = 1.75                      A2 = 1.75
    # t=1: delta = 0 + 0.5*0.25 - 1 = -0.875                A1 = -0.875 + 0.25*1.75 = -0.4375
    # t=0: delta = 1 + 0.5*1 - 0.5 = 1.0                    A0 = 1 + 0.25*(-0.4375) = 0.890625
    # returns = A + V = [1.390625, 0.5625, 2.0]
    adv, ret = compute_gae(_t([[1, 0, 2]]), _t([[0.5, 1, 0.25]]), torch.ones(1, 3), 0.5, 0.5)
    assert torch.allclose(adv, _t([[0.890625, -0.4375, 1.75]]))
    assert torch.allclose(ret, _t([[1.390625, 0.5625, 2.0]]))


def test_gae_skips_a_hole() -> None:
    # mask [1, 0, 1]: the hole (r = V = 99) is skipped, t=0 bootstraps from t=2
    # t=2: A2 = 2 - 0.25 = 1.75
    # t=0: delta = 1 + 0.5*0.25 - 0.5 = 0.625; A0 = 0.625 + 0.25*1.75 = 1.0625
    # returns = [1.0625 + 0.5, 0, 1.75 + 0.25] = [1.5625, 0, 2]
    mask = _t([[1, 0, 1]])
    adv, ret = compute_gae(_t([[1, 99, 2]]), _t([[0.5, 99, 0.25]]), mask, 0.5, 0.5)
    assert torch.allclose(adv, _t([[1.0625, 0.0, 1.75]]))
    assert torch.allclose(ret, _t([[1.5625, 0.0, 2.0]]))
    # whiten: advantages whitened over the valid tokens, returns keep the raw scale
    adv_w, ret_w = compute_gae(_t([[1, 99, 2]]), _t([[0.5, 99, 0.25]]), mask, 0.5, 0.5, True)
    assert torch.allclose(adv_w, masked_whiten(adv, mask))
    assert torch.equal(ret_w, ret)


@st.composite
def batches(draw: st.DrawFn, max_b: int = 6, max_t: int = 7) -> tuple[torch.Tensor, ...]:
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    flat_mask = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(flat_mask).reshape(b, t)
    rewards = torch.randn(b, t, generator=g, dtype=D)
    values = torch.randn(b, t, generator=g, dtype=D)
    return mask, rewards, values


@PROPS
@given(batches())
def test_gae_gamma_lam_one_is_return_to_go_minus_value(batch: tuple[torch.Tensor, ...]) -> None:
    mask, rewards, values = batch
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    kept = torch.where(mask, rewards, 0.0)
    rtg = kept.flip(-1).cumsum(-1).flip(-1)  # sum of valid rewards from t onwards
    assert torch.allclose(adv, torch.where(mask, rtg - values, 0.0), atol=1e-12)
    assert torch.allclose(ret, torch.where(mask, rtg, 0.0), atol=1e-12)


def test_discounted_returns_hand_case() -> None:
    # gamma 0.5, mask [1, 1, 0, 1], r = [1, 2, 50, 4]: G3 = 4, G1 = 2 + 0.5*4 = 4,
    # G0 = 1 + 0.5*4 = 3 (the hole is skipped, not counted as a step)
    g = discounted_returns(_t([[1, 2, 50, 4]]), _t([[1, 1, 0, 1]]), gamma=0.5)
    assert torch.equal(g, _t([[3, 4, 0, 4]]))


# ---------------------------------------------------------------- GRPO / Dr.GRPO / RLOO

# Six sequences, non-contiguous groups [0, 1, 0, 0, 1, 2], two tokens each (second column
# masked for rows 2-5). Token rewards sum to the scores s = [1, 2, 0, 0.5, 2, 3]:
#   group 0 = rows 0, 2, 3: s = 1, 0, 0.5 -> mean 0.5, unbiased std = sqrt((.25+.25+0)/2) = 0.5
#   group 1 = rows 1, 4:    s = 2, 2      -> equal rewards
#   group 2 = row 5:        s = 3         -> singleton
GROUPS = [0, 1, 0, 0, 1, 2]
REWARDS = _t([[0.25, 0.75], [0, 2], [0, 7], [0.5, 9], [2, -1], [3, 5]])
MASK = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 0], [1, 0], [1, 0]], dtype=D)


def _per_seq(adv: torch.Tensor) -> list[float]:
    return adv[:, 0].tolist()


def test_grpo_hand_case_with_singleton_and_equal_group() -> None:
    # group 0: (s - 0.5) / 0.5 = [1, -1, 0]; equal group -> 0; singleton -> 0
    adv, ret = compute_grpo(REWARDS, MASK, GROUPS, eps=0.0)
    assert _per_seq(adv) == pytest.approx([1.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    assert torch.equal(adv, ret)
    # broadcast to every valid token, 0 on masked ones
    assert adv[0, 1].item() == pytest.approx(1.0) and adv[2, 1].item() == 0.0
    # default eps = 1e-6: 0.5 / (0.5 + 1e-6)
    adv_eps, _ = compute_grpo(REWARDS, MASK, torch.tensor(GROUPS))
    assert adv_eps[0, 0].item() == pytest.approx(0.5 / (0.5 + 1e-6), rel=1e-12)
    # the equal-reward and singleton groups are EXACTLY 0 (not 1e-11 noise, not NaN)
    assert adv_eps[[1, 4, 5], 0].tolist() == [0.0, 0.0, 0.0]


def test_drgrpo_hand_case() -> None:
    # group 0: s - 0.5 = [0.5, -0.5, 0]; equal group and singleton -> 0
    adv, ret = compute_drgrpo(REWARDS, MASK, GROUPS)
    assert _per_seq(adv) == pytest.approx([0.5, 0.0, -0.5, 0.0, 0.0, 0.0])
    assert torch.equal(adv, compute_grpo(REWARDS, MASK, GROUPS, norm_by_std=False)[0])


def test_rloo_hand_case_with_singleton_and_equal_group() -> None:
    # group 0: s_i - mean of the others: 1 - (0+0.5)/2 = 0.75, 0 - 0.75 = -0.75,
    # 0.5 - 0.5 = 0 (= 3/2 * (s - 0.5)); equal group -> 0; singleton -> 0 (no baseline)
    adv, ret = compute_rloo(REWARDS, MASK, GROUPS)
    assert _per_seq(adv) == pytest.approx([0.75, 0.0, -0.75, 0.0, 0.0, 0.0])
    assert torch.equal(adv, ret)
    assert adv[5].tolist() == [0.0, 0.0]


# An episode split at a prefix break trains as several rows (segments) with its score and
# group: rows [A1, A2, B, C | D, E1, E2, E3], episodes A (score 1, 2 segments), B, C (0) in
# group 0; D (1), E (0, 3 segments) in group 1. Segments have different lengths.
EP_MASK = torch.tensor(
    [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]],
    dtype=D,
)
EP_SCORES = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
EP_REWARDS = torch.zeros(8, 3, dtype=D)
for _row, _score in enumerate(EP_SCORES):  # the score on each row's last valid token
    EP_REWARDS[_row, int(EP_MASK[_row].sum()) - 1] = _score
EP_GROUPS = [0, 0, 0, 0, 1, 1, 1, 1]
EPISODES = ["a", "a", "b", "c", "d", "e", "e", "e"]


def test_grpo_counts_an_episode_once_over_its_segments() -> None:
    # group 0 over episodes [1, 0, 0]: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2)
    # = sqrt(1/3): A = (2/3) / sqrt(1/3) = 2/sqrt(3) = 1.1547, B = C = -1/sqrt(3) = -0.5774.
    # group 1 over [1, 0]: mean 1/2, std sqrt(1/2): D = 1/sqrt(2), E = -1/sqrt(2).
    a, b, h = 2 / math.sqrt(3), -1 / math.sqrt(3), 1 / math.sqrt(2)
    adv, _ = compute_grpo(EP_REWARDS, EP_MASK, EP_GROUPS, eps=0.0, episode_index=EPISODES)
    assert _per_seq(adv) == pytest.approx([a, a, b, b, h, -h, -h, -h], rel=1e-12)
    assert torch.equal(adv, adv[:, :1] * EP_MASK)  # every valid token of every segment
    # per row (the old count): group 0 rows [1, 1, 0, 0] give A = 0.5 / sqrt(1/3) = 0.866,
    # group 1 rows [1, 0, 0, 0] D = 0.75 / 0.5 = 1.5: what episode_index corrects
    rows, _ = compute_grpo(EP_REWARDS, EP_MASK, EP_GROUPS, eps=0.0)
    assert _per_seq(rows)[0] == pytest.approx(0.5 * math.sqrt(3)) and _per_seq(rows)[4] == 1.5
    # through the dispatcher, as the trainer calls it
    via, _ = compute_advantages(
        "grpo",
        token_rewards=EP_REWARDS,
        response_mask=EP_MASK,
        group_index=torch.tensor(EP_GROUPS),
        episode_index=torch.tensor([0, 0, 1, 2, 3, 4, 4, 4]),
        eps=0.0,
    )
    assert torch.equal(via, adv)
    # one segment per episode: the same as without episode_index
    single = list(range(8))
    assert torch.equal(
        compute_grpo(EP_REWARDS, EP_MASK, EP_GROUPS, episode_index=single)[0],
        compute_grpo(EP_REWARDS, EP_MASK, EP_GROUPS)[0],
    )


def test_drgrpo_and_rloo_count_an_episode_once() -> None:
    # Dr.GRPO: group 0 A = 1 - 1/3 = 2/3, B = C = -1/3; group 1 D = 1/2, E = -1/2
    dr, _ = compute_drgrpo(EP_REWARDS, EP_MASK, EP_GROUPS, episode_index=EPISODES)
    third = 1 / 3
    assert _per_seq(dr) == pytest.approx(
        [2 * third, 2 * third, -third, -third] + [0.5] + [-0.5] * 3
    )
    # RLOO: A = 1 - mean(0, 0) = 1, B = 0 - mean(1, 0) = -1/2 = C; D = 1 - 0, E = 0 - 1
    rl, _ = compute_rloo(EP_REWARDS, EP_MASK, EP_GROUPS, episode_index=EPISODES)
    assert _per_seq(rl) == pytest.approx([1.0, 1.0, -0.5, -0.5, 1.0, -1.0, -1.0, -1.0])


def test_reinforce_plus_plus_baseline_counts_an_episode_once() -> None:
    # group means over episodes: group 0 [1, 0, 0] -> 1/3, group 1 [1, 0] -> 1/2 (per row
    # they would be 1/4 and 1/4). Before whitening every token of a row carries s - mean:
    # A 2/3 (both segments), B = C -1/3; D 1/2, E -1/2 (all three segments). The return-to-go
    # runs along an episode's rows: the score sits on its last row only (as row_outcomes puts
    # it), A1's G = A2's = 1 (tests/unit/algos/test_rpp_baseline_episodes.py for gamma < 1).
    rewards = EP_REWARDS.clone()
    rewards[0] = 0.0
    third = 1 / 3
    raw_seq = torch.tensor([2 * third, 2 * third, -third, -third, 0.5, -0.5, -0.5, -0.5], dtype=D)
    raw = raw_seq[:, None] * EP_MASK
    expected = masked_whiten(raw, EP_MASK.bool())
    for target in ("return", "score"):  # gamma 1, the score on the last token: they agree
        adv, _ = compute_reinforce_plus_plus_baseline(
            rewards, EP_MASK, EP_GROUPS, target=target, episode_index=EPISODES
        )
        assert torch.allclose(adv, expected, atol=1e-12)
    rows, _ = compute_reinforce_plus_plus_baseline(rewards, EP_MASK, EP_GROUPS)
    assert not torch.allclose(rows, expected, atol=1e-3)  # the per-row count differs
    via, _ = compute_advantages(
        "reinforce_plus_plus_baseline",
        token_rewards=rewards,
        response_mask=EP_MASK,
        group_index=torch.tensor(EP_GROUPS),
        episode_index=torch.tensor([0, 0, 1, 2, 3, 4, 4, 4]),
    )
    assert torch.equal(via, compute_reinforce_plus_plus_baseline(
        rewards, EP_MASK, EP_GROUPS, episode_index=EPISODES
    )[0])  # fmt: skip


def test_an_episode_scores_as_its_last_sequence_and_keeps_one_group() -> None:
    # row 1 (A's final turn) scores 0 instead: A = 0 like B and C, group 0 all equal -> 0
    rewards = EP_REWARDS.clone()
    rewards[1] = 0.0
    adv, _ = compute_grpo(rewards, EP_MASK, EP_GROUPS, episode_index=EPISODES)
    assert _per_seq(adv)[:4] == [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="one episode must share one group"):
        compute_grpo(EP_REWARDS, EP_MASK, EP_GROUPS, episode_index=[0, 0, 1, 2, 2, 4, 4, 4])


def test_group_ids_may_be_any_hashable_or_tensor() -> None:
    as_tensor = compute_grpo(REWARDS, MASK, torch.tensor([7, -3, 7, 7, -3, 100]))[0]
    as_str = compute_grpo(REWARDS, MASK, ["a", "b", "a", "a", "b", "c"])[0]
    assert torch.equal(as_tensor, compute_grpo(REWARDS, MASK, GROUPS)[0])
    assert torch.equal(as_str, as_tensor)
    with pytest.raises(ValueError, match="ids for 6 sequences"):
        compute_grpo(REWARDS, MASK, [0, 1])
    with pytest.raises(ValueError, match="integer ids"):
        compute_grpo(REWARDS, MASK, torch.zeros(6))


@st.composite
def grouped(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    b = draw(st.integers(1, 10))
    t = draw(st.integers(1, 4))
    groups = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    # rewards from a small set, so ties and equal-reward groups are common
    levels = st.sampled_from([0.0, 0.1, 0.5, 1.0, -2.0, 3.7])
    rewards = torch.tensor(draw(st.lists(levels, min_size=b * t, max_size=b * t)), dtype=D)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t)))
    return rewards.reshape(b, t), mask.reshape(b, t), groups


@PROPS
@given(grouped())
def test_group_advantages_sum_to_zero_and_degenerate_groups_are_zero(
    case: tuple[torch.Tensor, torch.Tensor, list[int]],
) -> None:
    rewards, mask, groups = case
    scores = torch.where(mask, rewards, 0.0).sum(-1)
    gidx = torch.tensor(groups)
    for fn in (compute_grpo, compute_drgrpo, compute_rloo):
        adv, _ = fn(rewards, mask, groups)
        assert torch.isfinite(adv).all()
        # the per-sequence level: the same scores with every token open (masked rewards -> 0)
        seq_adv = fn(torch.where(mask, rewards, 0.0), torch.ones_like(mask), groups)[0][:, 0]
        assert torch.equal(adv, torch.where(mask, seq_adv[:, None].expand_as(adv), 0.0))
        for g in set(groups):
            members = gidx == g
            if members.sum() >= 2:
                assert abs(seq_adv[members].sum().item()) < 1e-9, fn.__name__
            if members.sum() == 1 or torch.unique(scores[members]).numel() == 1:
                assert (seq_adv[members] == 0).all(), fn.__name__


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_hand_case() -> None:
    # gamma 0.5; seq 0: r = [0, 0, 1] -> G = [0.25, 0.5, 1]; seq 1: r = [0, 1, (masked 9)]
    # -> G = [0.5, 1, 0]. Valid G: .25 .5 1 .5 1, mean 0.65; deviations -.4 -.15 .35 -.15 .35
    # sum of squares .45, unbiased var .45/4 = .1125 -> A = dev / sqrt(.1125 + 1e-8)
    rewards = _t([[0, 0, 1], [0, 1, 9]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus(rewards, mask, gamma=0.5)
    assert torch.allclose(ret, _t([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    dev = _t([[-0.4, -0.15, 0.35], [-0.15, 0.35, 0.0]])
    assert torch.allclose(adv, dev / math.sqrt(0.1125 + 1e-8))


def test_reinforce_plus_plus_baseline_hand_case() -> None:
    # groups [0, 0, 1]; gamma 1; scores: seq0 = 1 (2 tokens), seq1 = 0 (2 tokens),
    # seq2 = 5 (singleton, 1 valid token). Group means 0.5, 0.5, 5.
    # Before whitening: seq0 +0.5, seq1 -0.5, seq2 0 -> valid values [.5 .5 -.5 -.5 0]
    # mean 0, unbiased var = 1/4 -> std 0.5 -> A = [1 1 | -1 -1 | 0 (masked 0)]
    rewards = _t([[0, 1], [0, 0], [5, 3]])
    mask = _t([[1, 1], [1, 1], [1, 0]])
    adv, ret = compute_reinforce_plus_plus_baseline(rewards, mask, [0, 0, 1])
    assert torch.allclose(adv, _t([[1, 1], [-1, -1], [0, 0]]), atol=1e-7)
    assert torch.equal(adv, ret)


# ---------------------------------------------------------------- dispatch


def test_compute_advantages_dispatch() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae", "grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    }  # fmt: skip
    adv, _ = compute_advantages(
        "grpo", token_rewards=REWARDS, response_mask=MASK, group_index=GROUPS, eps=0.0
    )
    assert torch.equal(adv, compute_grpo(REWARDS, MASK, GROUPS, eps=0.0)[0])
    # values given to an estimator without a critic are simply not passed
    adv_d, _ = compute_advantages(
        "drgrpo", token_rewards=REWARDS, response_mask=MASK, group_index=GROUPS, values=REWARDS
    )
    assert torch.equal(adv_d, compute_drgrpo(REWARDS, MASK, GROUPS)[0])
    adv_g, ret_g = compute_advantages(
        "gae", token_rewards=REWARDS, response_mask=MASK, values=REWARDS, gamma=0.9, lam=0.8
    )
    exp_adv, exp_ret = compute_gae(REWARDS, REWARDS, MASK, gamma=0.9, lam=0.8)
    assert torch.equal(adv_g, exp_adv) and torch.equal(ret_g, exp_ret)
    with pytest.raises(ValueError, match="known: .*'gae'.*'rloo'"):
        compute_advantages("ppo", token_rewards=REWARDS, response_mask=MASK)
    with pytest.raises(ValueError, match=r"does not accept \['lam'\]"):
        compute_advantages(
            "grpo", token_rewards=REWARDS, response_mask=MASK, group_index=GROUPS, lam=0.9
        )
    with pytest.raises(ValueError, match="does not accept"):  # drgrpo has no std to switch
        compute_advantages(
            "drgrpo", token_rewards=REWARDS, response_mask=MASK, group_index=GROUPS, eps=0.1
        )
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", token_rewards=REWARDS, response_mask=MASK)
    with pytest.raises(ValueError, match="needs group_index"):
        compute_advantages("rloo", token_rewards=REWARDS, response_mask=MASK)

"""REINFORCE++-baseline along a multi-turn episode trained as several rows (segments of a
prefix break, ``episode_index``): G_t runs on from a row's last valid token into the next row
of its episode (batch order), s_e = G at the episode's first valid token, counted once in its
group's mean: A = whiten(G_t - mean_g s) (target ``return``) or whiten(s_e - mean_g s) on every
token of every row of the episode (target ``score``), as over the unbroken episode with its
environment tokens masked. Hand-computed numbers, the split-vs-unbroken identity, the
unchanged result without ``episode_index``, and the controller's step 4 (score on the last
row only, ``row_outcomes``)."""

from __future__ import annotations

import random

import pytest
import torch

from relayrl.algos import (
    FixedKLController,
    compute_advantages,
    compute_reinforce_plus_plus_baseline,
    masked_whiten,
)
from relayrl.algos.advantages import (
    _group_centre,
    _group_inverse,
    _per_episode,
    discounted_returns,
)
from relayrl.algos.masked import as_bool_mask, zero_masked
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import (
    _estimator_kwargs,
    kl_shaped_rewards,
    last_token_rewards,
    row_outcomes,
)
from relayrl.rollout.types import Sample
from relayrl.workers import Experience

D = torch.float64

# Rows (T = 4). Episode a (group 0) is split: row 0 (its segment: tokens t 0-1, padding after)
# and row 3 (its last row: a masked bridge token at t 0, then t 1-2), apart in the batch.
# Group 0: a, b; group 1: c, d, e. The outcome sits on each episode's last valid token (a's on
# row 3 only); a0 carries a KL-like -0.1. Anything on a masked position (9, 7, 5) is ignored.
REWARDS = torch.tensor(
    [
        [-0.1, 0.0, 9.0, 9.0],  # a, segment
        [0.0, 0.0, 0.5, 7.0],  # b: score 0.5
        [0.0, 1.0, 0.0, 0.0],  # c: score 1
        [5.0, 0.0, 1.0, 0.0],  # a, last row: score 1
        [0.0, 0.0, 0.0, 0.0],  # d: score 0
        [0.25, 0.0, 0.0, 0.0],  # e: score 0.25
    ],
    dtype=D,
)
MASK = torch.tensor(
    [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
)
GROUPS = [0, 0, 1, 0, 1, 1]
EPISODES = ["a", "b", "c", "a", "d", "e"]


def _raw(rows: list[list[float]]) -> torch.Tensor:
    """Per-row values on the valid tokens (in order), 0 elsewhere."""
    out = torch.zeros(MASK.shape, dtype=D)
    for r, vals in enumerate(rows):
        out[r, MASK[r] > 0] = torch.tensor(vals, dtype=D)
    return out


def _expected(rows: list[list[float]]) -> torch.Tensor:
    return masked_whiten(_raw(rows), MASK)


def _rppb(rewards: torch.Tensor, gamma: float, target: str, **kw: object) -> torch.Tensor:
    adv, ret = compute_reinforce_plus_plus_baseline(
        rewards, MASK, GROUPS, gamma, target, episode_index=EPISODES, **kw
    )
    assert torch.equal(adv, ret)
    return adv


def test_gamma_one_by_hand() -> None:
    # a's valid tokens in order: a0 (row 0, r -0.1), a1 (row 0), a2 (row 3, t 1), a3 (row 3,
    # t 2, r 1): G = a3 1, a2 1, a1 1 (from row 3, not 0), a0 0.9; s_a = 0.9. b: G 0.5 x 3,
    # s_b 0.5; group 0 mean (0.9 + 0.5) / 2 = 0.7. c: G [1, 1], d: 0, e: 0.25; group 1 mean
    # 1.25 / 3 = 5/12.
    # return: a row 0 [0.2, 0.3], row 3 [0.3, 0.3]; b -0.2; c 7/12; d -5/12; e -1/6.
    c, d, e = 7 / 12, -5 / 12, -1 / 6
    ret = [[0.2, 0.3], [-0.2] * 3, [c, c], [0.3, 0.3], [d] * 4, [e]]
    torch.testing.assert_close(_rppb(REWARDS, 1.0, "return"), _expected(ret), rtol=0, atol=1e-12)
    # score: s_a - 0.7 = 0.2 on every token of both of a's rows
    score = [[0.2, 0.2], [-0.2] * 3, [c, c], [0.2, 0.2], [d] * 4, [e]]
    torch.testing.assert_close(_rppb(REWARDS, 1.0, "score"), _expected(score), rtol=0, atol=1e-12)


def test_gamma_0_9_by_hand() -> None:
    # a: a3 1, a2 0.9, a1 0.81, a0 -0.1 + 0.9 * 0.81 = 0.629 = s_a. b: G [0.405, 0.45, 0.5],
    # s_b 0.405; group 0 mean (0.629 + 0.405) / 2 = 0.517. c: G [0.9, 1], s 0.9; d 0; e 0.25;
    # group 1 mean 1.15 / 3.
    m1 = 1.15 / 3
    ret = [
        [0.112, 0.293],  # 0.629 - 0.517, 0.81 - 0.517
        [-0.112, -0.067, -0.017],
        [0.9 - m1, 1.0 - m1],
        [0.383, 0.483],  # 0.9 - 0.517, 1 - 0.517
        [-m1] * 4,
        [0.25 - m1],
    ]
    torch.testing.assert_close(_rppb(REWARDS, 0.9, "return"), _expected(ret), rtol=0, atol=1e-12)
    score = [[0.112] * 2, [-0.112] * 3, [0.9 - m1] * 2, [0.112] * 2, [-m1] * 4, [0.25 - m1]]
    torch.testing.assert_close(_rppb(REWARDS, 0.9, "score"), _expected(score), rtol=0, atol=1e-12)
    # through the dispatcher (what grpo_step calls), tensor ids as well as any hashables
    via, _ = compute_advantages(
        "reinforce_plus_plus_baseline",
        token_rewards=REWARDS,
        response_mask=MASK,
        group_index=torch.tensor(GROUPS),
        episode_index=torch.tensor([4, 1, 2, 4, 0, 3]),
        gamma=0.9,
        target="score",
    )
    torch.testing.assert_close(via, _expected(score), rtol=0, atol=1e-12)


def test_a_winning_episodes_first_row_is_not_pushed_down() -> None:
    # The defect this fixes: rows taken one by one, row 0 of a (a winner, s_a = 0.9 > b's 0.5)
    # had G = [-0.1, 0] (no outcome on it) and so a negative advantage, below the loser b's.
    # Chained, every token of a is above every token of b (gamma 1, both targets).
    for target in ("return", "score"):
        adv = _rppb(REWARDS, 1.0, target)
        a_tokens = torch.cat([adv[0, :2], adv[3, 1:3]])
        assert a_tokens.min() > adv[1, :3].max(), target
        assert (adv[0, :2] > 0).all(), target


def test_singleton_score_convention_and_an_episode_without_tokens() -> None:
    # e alone in group 2 (singleton "score": baseline 0, A = its own G); a's segment row 0
    # emptied: s_a = G at row 3's first valid token = 1; group 0 mean (1 + 0.5) / 2 = 0.75.
    mask = MASK.clone()
    mask[0] = 0
    groups = [0, 0, 1, 0, 1, 2]
    adv, _ = compute_reinforce_plus_plus_baseline(
        REWARDS, mask, groups, 1.0, "return", "score", EPISODES
    )
    raw = torch.zeros(MASK.shape, dtype=D)
    raw[1, :3], raw[3, 1:3] = -0.25, 0.25
    raw[2, :2], raw[4] = 0.5, -0.5  # group 1: c 1, d 0, mean 0.5
    raw[5, 0] = 0.25
    torch.testing.assert_close(adv, masked_whiten(raw, mask), rtol=0, atol=1e-12)
    assert (adv[0] == 0).all()
    # an episode with no valid token at all: s = 0, nothing to train
    mask[3] = 0
    adv, _ = compute_reinforce_plus_plus_baseline(
        REWARDS, mask, groups, 1.0, "score", "zero", EPISODES
    )
    assert (adv[0] == 0).all() and (adv[3] == 0).all()
    raw = torch.zeros(MASK.shape, dtype=D)
    raw[1, :3] = 0.25  # group 0 over episodes [a 0, b 0.5]: mean 0.25
    raw[2, :2], raw[4] = 0.5, -0.5
    torch.testing.assert_close(adv, masked_whiten(raw, mask), rtol=0, atol=1e-12)


def _reference_without_episodes(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: list[int],
    gamma: float,
    target: str,
    singleton: str,
) -> torch.Tensor:
    """compute_reinforce_plus_plus_baseline as it was before episodes chained (commit
    1fcb3ee), without episode_index: each row its own G_t and s_i."""
    mask = as_bool_mask(response_mask)
    returns = discounted_returns(token_rewards, mask, gamma)
    batch, length = mask.shape
    positions = torch.arange(length).expand(batch, length)
    first = torch.where(mask, positions, length).amin(-1)
    has_tokens = first < length
    start = returns.gather(1, first.clamp(max=length - 1).long()[:, None]).squeeze(1)
    scores = torch.where(has_tokens, start, torch.zeros_like(start))
    row_inverse = _group_inverse(group_index, batch, scores.device)
    ep_scores, ep_inverse, _ = _per_episode(scores, row_inverse, None)
    centred, counts = _group_centre(ep_scores, ep_inverse)
    baseline = ep_scores - centred
    if singleton == "score":
        baseline = torch.where(counts >= 2, baseline, torch.zeros_like(baseline))
    if target == "return":
        raw = returns - baseline[:, None]
    else:
        raw = (scores - baseline)[:, None].expand_as(returns)
    return masked_whiten(zero_masked(raw, mask), mask)


@pytest.mark.parametrize("seed", range(8))
def test_without_episode_index_the_result_is_unchanged(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch, length = 7, 5
    rewards = torch.randn(batch, length, generator=g, dtype=D)
    mask = torch.rand(batch, length, generator=g) < 0.6
    mask[seed % batch] = False  # an empty row
    groups = torch.randint(0, 3, (batch,), generator=g).tolist()
    for gamma in (1.0, 0.9):
        for target in ("return", "score"):
            for singleton in ("zero", "score"):
                new, _ = compute_reinforce_plus_plus_baseline(
                    rewards, mask, groups, gamma, target, singleton
                )
                old = _reference_without_episodes(rewards, mask, groups, gamma, target, singleton)
                assert torch.equal(new, old), (gamma, target, singleton)
                # one row per episode: the same numbers
                own, _ = compute_reinforce_plus_plus_baseline(
                    rewards, mask, groups, gamma, target, singleton, list(range(batch))
                )
                torch.testing.assert_close(own, new, rtol=0, atol=1e-12)


def _split_batch(seed: int) -> tuple[list[list[int]], dict[str, object]]:
    """Unbroken episodes (one row each: model tokens valid, environment tokens masked, a KL-like
    reward on every token and the score on the last valid one; groups of 3, 2 and 1 episodes)
    and the same episodes cut into 1-3 rows, rows of different episodes interleaved (each
    episode's own in order), each with maybe a masked lead token, right-padded; garbage on
    masked positions. Returns (for each episode, the split batch's flat index of each of its
    valid tokens) and the tensors."""
    rng = random.Random(seed)
    groups = [0, 0, 0, 1, 1, 2]
    n_ep, length = len(groups), 10
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n_ep, length, generator=g) < 0.7).long()
    mask[:, 0] = 1
    rewards = 0.1 * torch.randn(n_ep, length, generator=g, dtype=D)
    for e in range(n_ep):  # the score on the last valid token
        last = int(mask[e].nonzero()[-1])
        rewards[e, last] += float(rng.choice([0.0, 0.5, 1.0]))
    pieces: list[list[tuple[int, int, int]]] = []
    for e in range(n_ep):
        cuts = sorted(rng.sample(range(1, length), rng.randint(0, 2)))
        bounds = [0, *cuts, length]
        pieces.append([(e, a, b) for a, b in zip(bounds, bounds[1:], strict=False)])
    order: list[tuple[int, int, int]] = []
    while any(pieces):
        order.append(pieces[rng.choice([i for i, p in enumerate(pieces) if p])].pop(0))
    width = length + 1
    s_mask = torch.zeros(len(order), width, dtype=torch.long)
    s_rewards = torch.full((len(order), width), 11.0, dtype=D)
    where: list[list[int]] = [[] for _ in range(n_ep)]
    for r, (e, a, b) in enumerate(order):
        lead = rng.randint(0, 1)
        s_mask[r, lead : lead + b - a] = mask[e, a:b]
        s_rewards[r, lead : lead + b - a] = torch.where(mask[e, a:b] > 0, rewards[e, a:b], 11.0)
        where[e].extend(r * width + lead + t - a for t in range(a, b) if mask[e, t])
    return where, {
        "rewards": torch.where(mask > 0, rewards, 17.0),
        "mask": mask,
        "groups": groups,
        "s_rewards": s_rewards,
        "s_mask": s_mask,
        "s_groups": [groups[e] for e, _, _ in order],
        "episodes": [e for e, _, _ in order],
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("target", ["return", "score"])
@pytest.mark.parametrize("singleton", ["zero", "score"])
def test_a_split_episode_gets_the_unbroken_episodes_advantages(
    seed: int, gamma: float, target: str, singleton: str
) -> None:
    where, b = _split_batch(seed)
    whole, _ = compute_reinforce_plus_plus_baseline(
        b["rewards"], b["mask"], b["groups"], gamma, target, singleton
    )
    split, _ = compute_reinforce_plus_plus_baseline(
        b["s_rewards"], b["s_mask"], b["s_groups"], gamma, target, singleton, b["episodes"]
    )
    for e, flat in enumerate(where):
        torch.testing.assert_close(
            split.reshape(-1)[torch.tensor(flat)], whole[e][b["mask"][e] > 0], rtol=0, atol=1e-12
        )
    assert torch.all(split[b["s_mask"] == 0] == 0)


def _step_exp(split: bool) -> tuple[Experience, list[int]]:
    """Episode 0 (group 0) split: row 0 (segment, model tokens 3 4), row 1 (its own sample,
    model token 5), or as one row (3 4, the environment's 8 8 masked, 5); episode 1 (group 0,
    2 tokens) and episode 2 (group 1, 1 token). Every row has its episode's score, as
    ``expand_episodes`` gives them."""
    s = [
        Sample(0, [1, 2], [3, 4], [0.0, 0.0], [0, 0], "stop", 0),
        Sample(0, [1, 2, 3, 4, 8, 8], [5], [0.0], [0], "eos", 0),
    ]
    if not split:
        s = [Sample(0, [1, 2], [3, 4, 8, 8, 5], [0.0] * 5, [0] * 5, "eos", 0)]
        s[0].loss_mask = [1, 1, 0, 0, 1]
    samples = [
        *s,
        Sample(1, [1, 2], [3, 4], [0.0, 0.0], [0, 0], "eos", 0),
        Sample(2, [1, 2], [6], [0.0], [0], "eos", 1),
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    episodes = [0, 0, 1, 2] if split else [0, 1, 2]
    exp.scores = torch.tensor([1.0, 1.0, 0.0, 0.5] if split else [1.0, 0.0, 0.5])
    # k1 KL d = old - ref: episode 0 tokens [0.2, 0.4, (env), 1.0], episode 1 [0.4, 0.2],
    # episode 2 [0.6]
    if split:
        old = [[-1.0, -1.0], [-0.5, 0.0], [-1.0, -1.0], [-1.0, 0.0]]
        ref = [[-1.2, -1.4], [-1.5, 0.0], [-1.4, -1.2], [-1.6, 0.0]]
    else:
        old = [[-1.0, -1.0, -3.0, -3.0, -0.5], [-1.0, -1.0, 0, 0, 0], [-1.0, 0, 0, 0, 0]]
        ref = [[-1.2, -1.4, -9.0, -9.0, -1.5], [-1.4, -1.2, 0, 0, 0], [-1.6, 0, 0, 0, 0]]
    exp.old_logprobs, exp.ref_logprobs = torch.tensor(old), torch.tensor(ref)
    return exp, episodes


def _step4(exp: Experience, episodes: list[int], kl_in: str, target: str) -> torch.Tensor:
    """grpo_step's step 4 under REINFORCE++-baseline, gamma 0.9, beta 0.5."""
    cfg = load_config(
        RunConfig,
        None,
        [
            "algo.advantage=reinforce_plus_plus_baseline",
            f"algo.rfpp_baseline_target={target}",
            f"algo.kl_in={kl_in}",
            "algo.kl_coef=0.5",
            "algo.gamma=0.9",
        ],
    )
    split = len(set(episodes)) < len(episodes)
    assert exp.scores is not None
    if kl_in == "reward":
        rewards = kl_shaped_rewards(exp, cfg, FixedKLController(0.5), episodes if split else None)
    else:
        outcome = row_outcomes(exp.scores, exp.response_mask, episodes, cfg.algo.advantage_name)
        rewards = last_token_rewards(outcome, exp.response_mask)
    adv, _ = compute_advantages(
        cfg.algo.advantage_name,
        token_rewards=rewards,
        response_mask=exp.response_mask,
        group_index=exp.group_index,
        episode_index=episodes if split else None,
        **_estimator_kwargs(cfg),
    )
    return adv


def test_the_step_gives_a_split_episode_the_unbroken_episodes_advantages() -> None:
    # row_outcomes: the score on the episode's last row only
    exp, episodes = _step_exp(True)
    assert exp.scores is not None
    outcome = row_outcomes(exp.scores, exp.response_mask, episodes, "reinforce_plus_plus_baseline")
    torch.testing.assert_close(outcome, torch.tensor([0.0, 1.0, 0.0, 0.5]))
    # KL in the reward, gamma 0.9, beta 0.5, target return: episode 0's rewards [-0.1, -0.2 |
    # -0.5 + 1] -> G [-0.1 + 0.9 * 0.25, -0.2 + 0.9 * 0.5, 0.5] = [0.125, 0.25, 0.5], s = 0.125;
    # episode 1: r [-0.2, -0.1] -> G [-0.2 + 0.9 * -0.1, -0.1] = [-0.29, -0.1], s = -0.29;
    # group 0 mean -0.0825. Episode 2 alone in group 1 (singleton zero: baseline s, raw 0).
    # Raw [0.2075, 0.3325 | 0.5825 | -0.2075, -0.0175 | 0].
    adv = _step4(exp, episodes, "reward", "return")
    raw = torch.tensor([[0.2075, 0.3325], [0.5825, 0.0], [-0.2075, -0.0175], [0.0, 0.0]])
    torch.testing.assert_close(adv, masked_whiten(raw, exp.response_mask), atol=1e-6, rtol=0)
    for kl_in in ("reward", "loss"):
        for target in ("return", "score"):
            s_exp, s_eps = _step_exp(True)
            w_exp, w_eps = _step_exp(False)
            s_adv = _step4(s_exp, s_eps, kl_in, target)
            w_adv = _step4(w_exp, w_eps, kl_in, target)
            model = w_exp.response_mask[0] > 0
            torch.testing.assert_close(
                w_adv[0][model], torch.cat([s_adv[0], s_adv[1, :1]]), atol=1e-6, rtol=0
            )
            torch.testing.assert_close(w_adv[1:, :2], s_adv[2:], atol=1e-6, rtol=0)

"""GAE and REINFORCE++ returns along a multi-turn episode trained as several rows (segments
of a prefix break, ``episode_index``): the recurrence runs on from a row's last valid token
into the next row of its episode, in batch order, exactly as over the unbroken episode with
its environment tokens masked. Hand-computed numbers, then the split-vs-unbroken identity."""

import random

import pytest
import torch

from relayrl.algos import compute_advantages, compute_gae, discounted_returns

D = torch.float64

# Rows (T = 4): 0 = episode A's first segment (2 model tokens, then padding), 1 = episode B
# (unsplit, 3 tokens), 2 = episode A's last row (a masked environment token at t = 1, padding
# at t = 3). Whatever sits on a masked position (5, 7, 9) must be ignored.
REWARDS = torch.tensor([[-0.1, 0.0, 5.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 7.0, 2.0, 0.0]], dtype=D)
VALUES = torch.tensor([[0.5, 0.4, 9.0, 9.0], [0.2, 0.1, 0.4, 9.0], [0.3, 9.0, 0.6, 9.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0]])
EPISODES = ["A", "B", "A"]


def test_gae_runs_on_across_an_episodes_rows_by_hand() -> None:
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72). Episode A's valid tokens in order:
    # a0 (row 0, t 0: V 0.5, r -0.1), a1 (row 0, t 1: V 0.4), a2 (row 2, t 0: V 0.3),
    # a3 (row 2, t 2: V 0.6, r 2).
    # a3: delta = 2 - 0.6 = 1.4                       A = 1.4
    # a2: delta = 0.9 * 0.6 - 0.3 = 0.24              A = 0.24 + 0.72 * 1.4 = 1.248
    # a1: delta = 0.9 * 0.3 - 0.4 = -0.13 (V of row 2's first token, not 0)
    #                                                 A = -0.13 + 0.72 * 1.248 = 0.76856
    # a0: delta = -0.1 + 0.9 * 0.4 - 0.5 = -0.24      A = -0.24 + 0.72 * 0.76856 = 0.3133632
    # B: b2 delta = 1 - 0.4 = 0.6, A 0.6; b1 delta = 0.9 * 0.4 - 0.1 = 0.26, A = 0.26 + 0.72 *
    # 0.6 = 0.692; b0 delta = 0.9 * 0.1 - 0.2 = -0.11, A = -0.11 + 0.72 * 0.692 = 0.38824.
    # Returns R = A + V.
    adv, ret = compute_gae(REWARDS, VALUES, MASK, 0.9, 0.8, episode_index=EPISODES)
    expected = torch.tensor(
        [[0.3133632, 0.76856, 0, 0], [0.38824, 0.692, 0.6, 0], [1.248, 0, 1.4, 0]], dtype=D
    )
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, (expected + VALUES) * MASK, rtol=0, atol=1e-12)
    # rows taken one by one (no episode_index), row 0 ends its own recurrence: a1 = -0.4
    alone, _ = compute_gae(REWARDS, VALUES, MASK, 0.9, 0.8)
    assert alone[0, 1].item() == pytest.approx(-0.4)
    torch.testing.assert_close(alone[1:2], expected[1:2], rtol=0, atol=1e-12)
    # through the dispatcher (what ppo_step calls), tensor ids as well as any hashables
    via, _ = compute_advantages(
        "gae",
        token_rewards=REWARDS,
        response_mask=MASK,
        values=VALUES,
        episode_index=torch.tensor([3, 1, 3]),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(via, expected, rtol=0, atol=1e-12)


def test_return_to_go_runs_on_across_an_episodes_rows_by_hand() -> None:
    # gamma = 0.9: a3 = 2, a2 = 1.8, a1 = 0 + 0.9 * 1.8 = 1.62, a0 = -0.1 + 0.9 * 1.62 = 1.358;
    # B: 1, 0.9, 0.81. REINFORCE++ whitens these returns over the batch's valid tokens.
    g = discounted_returns(REWARDS, MASK, 0.9, episode_index=EPISODES)
    expected = torch.tensor([[1.358, 1.62, 0, 0], [0.81, 0.9, 1.0, 0], [1.8, 0, 2.0, 0]], dtype=D)
    torch.testing.assert_close(g, expected, rtol=0, atol=1e-12)
    _, rpp = compute_advantages(
        "reinforce_plus_plus",
        token_rewards=REWARDS,
        response_mask=MASK,
        episode_index=EPISODES,
        gamma=0.9,
    )
    torch.testing.assert_close(rpp, expected, rtol=0, atol=1e-12)


def test_a_row_without_a_valid_token_passes_the_bootstrap_on() -> None:
    # episode [row 0, row 1 (all masked), row 2]: row 0 bootstraps from row 2's first token
    rewards = torch.tensor([[0.0], [3.0], [1.0]], dtype=D)
    values = torch.tensor([[0.5], [8.0], [0.25]], dtype=D)
    mask = torch.tensor([[1], [0], [1]])
    adv, _ = compute_gae(rewards, values, mask, 0.5, 0.5, episode_index=[0, 0, 0])
    # row 2: A = 1 - 0.25 = 0.75; row 0: delta = 0.5 * 0.25 - 0.5 = -0.375, A = -0.375 +
    # 0.25 * 0.75 = -0.1875
    torch.testing.assert_close(adv, torch.tensor([[-0.1875], [0.0], [0.75]], dtype=D))


def _split_batch(seed: int) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Unbroken episodes (one row each: model tokens valid, environment tokens masked) and
    the same episodes cut into 1-3 rows at random, rows of different episodes interleaved
    (each episode's rows in order), each row right-padded; garbage on masked positions.
    Returns (for each unbroken row, the split batch's (row, t) of each valid token) and the
    tensors."""
    rng = random.Random(seed)
    n_ep, length = 4, 12
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n_ep, length, generator=g) < 0.7).long()
    mask[:, 0] = 1
    rewards = torch.randn(n_ep, length, generator=g, dtype=D)  # the KL terms, any real
    values = torch.randn(n_ep, length, generator=g, dtype=D)
    pieces: list[list[tuple[int, int, int]]] = []  # per episode: (episode, start, end)
    for e in range(n_ep):
        cuts = sorted(rng.sample(range(1, length), rng.randint(0, 2)))
        bounds = [0, *cuts, length]
        pieces.append([(e, a, b) for a, b in zip(bounds, bounds[1:], strict=False)])
    order: list[tuple[int, int, int]] = []
    while any(pieces):  # interleave episodes, each keeping its own order
        order.append(pieces[rng.choice([i for i, p in enumerate(pieces) if p])].pop(0))
    rows = len(order)
    width = length + 1  # room for a leading masked token
    s_mask = torch.zeros(rows, width, dtype=torch.long)
    s_rewards = torch.full((rows, width), 11.0, dtype=D)
    s_values = torch.full((rows, width), -13.0, dtype=D)
    where: list[list[int]] = [[] for _ in range(n_ep)]
    for r, (e, a, b) in enumerate(order):
        lead = rng.randint(0, 1)  # a masked token first (the re-rendered bridge)
        n = b - a
        s_mask[r, lead : lead + n] = mask[e, a:b]
        s_rewards[r, lead : lead + n] = torch.where(mask[e, a:b] > 0, rewards[e, a:b], 11.0)
        s_values[r, lead : lead + n] = torch.where(mask[e, a:b] > 0, values[e, a:b], -13.0)
        where[e].extend(r * width + lead + t - a for t in range(a, b) if mask[e, t])
    rewards = torch.where(mask > 0, rewards, 17.0)  # garbage where masked
    values = torch.where(mask > 0, values, 19.0)
    return where, {
        "rewards": rewards,
        "values": values,
        "mask": mask,
        "s_rewards": s_rewards,
        "s_values": s_values,
        "s_mask": s_mask,
        "episodes": torch.tensor([e for e, _, _ in order]),
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("whiten", [False, True])
def test_a_split_episode_gets_the_unbroken_episodes_advantages(seed: int, whiten: bool) -> None:
    where, b = _split_batch(seed)
    adv, ret = compute_gae(b["rewards"], b["values"], b["mask"], 0.9, 0.8, whiten)
    s_adv, s_ret = compute_gae(
        b["s_rewards"], b["s_values"], b["s_mask"], 0.9, 0.8, whiten, b["episodes"]
    )
    g = discounted_returns(b["rewards"], b["mask"], 0.9)
    s_g = discounted_returns(b["s_rewards"], b["s_mask"], 0.9, b["episodes"])
    for e, flat in enumerate(where):
        valid = b["mask"][e] > 0
        idx = torch.tensor(flat)
        for whole, split in ((adv, s_adv), (ret, s_ret), (g, s_g)):
            torch.testing.assert_close(split.reshape(-1)[idx], whole[e][valid])
    assert int((s_adv != 0).sum()) <= int(b["s_mask"].sum())  # 0 where masked
    assert torch.all(s_adv[b["s_mask"] == 0] == 0) and torch.all(s_ret[b["s_mask"] == 0] == 0)
    # the rows taken one by one do not match (the bug this fixes: a cut episode somewhere)
    if len(b["episodes"]) > len(where):
        one_by_one, _ = compute_gae(b["s_rewards"], b["s_values"], b["s_mask"], 0.9, 0.8, whiten)
        assert not torch.allclose(one_by_one, s_adv)

"""PPO's advantages for a multi-turn episode split at a prefix break (``ppo_step``'s step 4):
the episode's score on its last row only (``row_outcomes``), the KL reward on every token,
GAE along its rows in order; the same advantages and returns as the unbroken episode (one
row, its environment tokens masked). Numbers worked out in the comments."""

from __future__ import annotations

import torch

from relayrl.algos import FixedKLController, compute_advantages
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import kl_shaped_rewards, last_token_rewards, row_outcomes
from relayrl.rollout.types import Sample
from relayrl.workers import Experience


def test_the_score_goes_on_an_episodes_last_row_with_a_token() -> None:
    scores = torch.tensor([1.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1], [1, 0], [0, 0]])
    episodes = [0, 0, 1, 2, 2, 2]  # episode 2's last row has no valid token: row 4 gets it
    out = row_outcomes(scores, mask, episodes, "gae")
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 0.0]))
    torch.testing.assert_close(row_outcomes(scores, mask, episodes, "reinforce_plus_plus"), out)
    # group estimators read the last row's sum; nothing split: unchanged
    assert row_outcomes(scores, mask, episodes, "grpo") is scores
    assert row_outcomes(scores, mask, list(range(6)), "gae") is scores
    # the KL in the loss: r_t = the row's outcome on its last token
    rewards = last_token_rewards(out, mask)
    torch.testing.assert_close(rewards[:2], torch.tensor([[0.0, 0.0], [1.0, 0.0]]))


def _ppo(kl_in: str) -> RunConfig:
    cfg = load_config(
        RunConfig,
        None,
        ["algo.name=ppo", f"algo.kl_in={kl_in}", "algo.kl_coef=0.5", "algo.group_size=1"],
    )
    assert cfg.algo.advantage_name == "gae"
    return cfg


def _rewards_and_gae(exp: Experience, episodes: list[int], kl_in: str) -> tuple:
    """ppo_step's step 4 on ``exp`` (episodes as ``admit`` gives them), gamma 0.9, lam 0.8."""
    cfg = _ppo(kl_in)
    split = len(set(episodes)) < len(episodes)
    assert exp.scores is not None
    if kl_in == "reward":
        rewards = kl_shaped_rewards(exp, cfg, FixedKLController(0.5), episodes if split else None)
    else:
        outcome = row_outcomes(exp.scores, exp.response_mask, episodes, "gae")
        rewards = last_token_rewards(outcome, exp.response_mask)
    adv, ret = compute_advantages(
        "gae",
        token_rewards=rewards,
        response_mask=exp.response_mask,
        values=exp.values,
        episode_index=episodes if split else None,
        gamma=0.9,
        lam=0.8,
    )
    return rewards, adv, ret


def _split() -> Experience:
    """Episode 0 split: row 0 (segment, model tokens 3 4) and row 1 (its own sample, the
    re-rendered context in its prompt, model token 5); episode 1 = row 2, unsplit."""
    samples = [
        Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", 0),
        Sample(0, [1, 2, 3, 4, 8, 8], [5], [-0.1], [0], "eos", 0),
        Sample(1, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "eos", 1),
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.scores = torch.tensor([1.0, 1.0, 0.0])  # expand_episodes: every row has the score
    exp.old_logprobs = torch.tensor([[-1.0, -1.0], [-0.5, 0.0], [-1.0, -1.0]])
    exp.ref_logprobs = torch.tensor([[-1.2, -1.4], [-1.5, 0.0], [-1.4, -1.2]])
    exp.values = torch.tensor([[0.5, 0.4], [0.3, 7.0], [0.2, 0.1]])
    return exp


def _unbroken() -> Experience:
    """Episode 0 as one row: 3 4, the environment's 8 8 (masked), 5; then episode 1."""
    samples = [
        Sample(0, [1, 2], [3, 4, 8, 8, 5], [-0.1, -0.2, 0, 0, -0.1], [0] * 5, "eos", 0),
        Sample(1, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "eos", 1),
    ]
    samples[0].loss_mask = [1, 1, 0, 0, 1]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.scores = torch.tensor([1.0, 0.0])
    exp.old_logprobs = torch.tensor([[-1.0, -1.0, -3.0, -3.0, -0.5], [-1.0, -1.0, 0, 0, 0]])
    exp.ref_logprobs = torch.tensor([[-1.2, -1.4, -9.0, -9.0, -1.5], [-1.4, -1.2, 0, 0, 0]])
    exp.values = torch.tensor([[0.5, 0.4, 6.0, 6.0, 0.3], [0.2, 0.1, 0, 0, 0]])
    return exp


def test_a_split_episode_trains_with_the_unbroken_episodes_advantages() -> None:
    """k1, beta 0.5, gamma 0.9, lam 0.8 (gamma * lam = 0.72). KL d: row 0 [0.2, 0.4], row 1
    [1.0], row 2 [0.4, 0.2]. Rewards: row 0 [-0.1, -0.2] (no score: not the episode's last
    row), row 1 [-0.5 + 1] = [0.5], row 2 [-0.2, -0.1]. GAE along episode 0 (V 0.5, 0.4, 0.3):
    e2: A = 0.5 - 0.3 = 0.2;  e1: delta = -0.2 + 0.9 * 0.3 - 0.4 = -0.33 (V of row 1's token),
    A = -0.33 + 0.72 * 0.2 = -0.186;  e0: delta = -0.1 + 0.9 * 0.4 - 0.5 = -0.24,
    A = -0.24 + 0.72 * -0.186 = -0.37392. Row 2: A = [-0.31 + 0.72 * -0.2, -0.2] =
    [-0.454, -0.2]. R = A + V."""
    exp = _split()
    rewards, adv, ret = _rewards_and_gae(exp, [0, 0, 1], "reward")
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, -0.2], [0.5, 0.0], [-0.2, -0.1]]))
    expected = torch.tensor([[-0.37392, -0.186], [0.2, 0.0], [-0.454, -0.2]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, (expected + exp.values) * exp.response_mask, atol=1e-6, rtol=0)
    # the unbroken episode, environment tokens masked: the same on its model tokens
    whole = _unbroken()
    w_rewards, w_adv, w_ret = _rewards_and_gae(whole, [0, 1], "reward")
    model = whole.response_mask[0] > 0
    torch.testing.assert_close(w_adv[0][model], torch.cat([adv[0], adv[1, :1]]))
    torch.testing.assert_close(w_ret[0][model], torch.cat([ret[0], ret[1, :1]]))
    torch.testing.assert_close(w_adv[1, :2], adv[2])
    # the KL in the loss: the score alone, on the episode's last row
    _, s_adv, s_ret = _rewards_and_gae(_split(), [0, 0, 1], "loss")
    _, u_adv, u_ret = _rewards_and_gae(_unbroken(), [0, 1], "loss")
    torch.testing.assert_close(u_adv[0][model], torch.cat([s_adv[0], s_adv[1, :1]]))
    torch.testing.assert_close(u_ret[0][model], torch.cat([s_ret[0], s_ret[1, :1]]))

"""The step's KL glue (``controller.algorithms``): the KL-shaped token rewards of a step with
``algo.kl_in: reward``, an adaptive beta handed to the actor's KL loss term, and the adaptive
controller fed by whichever KL the step measured. Numbers worked out in the comments."""

from __future__ import annotations

import pytest
import torch

from relayrl.algos import AdaptiveKLController, FixedKLController, compute_advantages
from relayrl.config import RunConfig, load_config
from relayrl.controller.algorithms import adapt_kl, kl_shaped_rewards, set_kl_loss_coef
from relayrl.rollout.types import Sample
from relayrl.workers import Experience


def _exp() -> Experience:
    """Two rows: 2 response tokens and 1 (then padding)."""
    samples = [
        Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "eos", 0),
        Sample(1, [1, 2], [3], [-0.1], [0], "eos", 0),
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.scores = torch.tensor([1.0, 0.0])
    exp.old_logprobs = torch.tensor([[-1.0, -1.0], [-0.5, 0.0]])
    exp.ref_logprobs = torch.tensor([[-1.2, -1.4], [-1.5, 0.0]])  # d = [0.2, 0.4], [1.0]
    return exp


def test_kl_shaped_rewards_of_a_grpo_step():
    cfg = load_config(RunConfig, None, ["algo.kl_in=reward", "algo.kl_coef=0.5"])
    exp = _exp()
    rewards = kl_shaped_rewards(exp, cfg, FixedKLController(0.5))
    # k1, beta 0.5: row 0 [-0.1, -0.2 + 1] ; row 1 [-0.5, 0 (padding)]
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.8], [-0.5, 0.0]]))
    torch.testing.assert_close(exp.kl, torch.tensor([[0.2, 0.4], [1.0, 0.0]]))


def test_adaptive_kl_follows_the_reward_kl():
    """kl_in_reward = token mean (0.2 + 0.4 + 1.0) / 3 = 0.533333; target 0.5: err =
    clip(0.533333 / 0.5 - 1, +-0.2) = 0.066667; beta = 0.1 * (1 + 0.066667 * 2 / 100)."""
    cfg = load_config(RunConfig, None, ["algo.kl_in=reward", "algo.kl_coef=0.1"])
    exp = _exp()
    kl_shaped_rewards(exp, cfg, FixedKLController(0.1))
    ctl = AdaptiveKLController(0.1, 0.5, 100)
    stats: dict[str, float] = {}
    adapt_kl(exp, cfg, ctl, stats)
    assert stats["kl_in_reward"] == pytest.approx(0.533333, abs=1e-6)
    assert stats["kl_beta"] == pytest.approx(0.1 * (1 + 0.066667 * 2 / 100), abs=1e-8)


def test_adaptive_kl_follows_the_loss_kl_and_reaches_the_actor():
    """actor/kl 0.1, target 0.05: err = clip(0.1 / 0.05 - 1, +-0.2) = 0.2; over 2 rows,
    horizon 100: beta = 0.1 * (1 + 0.2 * 2 / 100) = 0.1004."""
    cfg = load_config(RunConfig, None, ["algo.kl_coef=0.1", "algo.adaptive_kl_target=0.05"])
    ctl = AdaptiveKLController(0.1, 0.05, 100)
    exp = _exp()
    set_kl_loss_coef(exp, cfg, ctl)
    torch.testing.assert_close(exp.kl_coefs, torch.tensor([0.1, 0.1]))
    stats = {"actor/kl": 0.1}
    adapt_kl(exp, cfg, ctl, stats)
    assert "kl_in_reward" not in stats
    assert stats["kl_beta"] == pytest.approx(0.1004, abs=1e-12)
    exp = _exp()
    set_kl_loss_coef(exp, cfg, ctl)  # the next step's actor gets the new beta
    torch.testing.assert_close(exp.kl_coefs, torch.tensor([0.1004, 0.1004]))


def test_no_kl_no_change():
    """A fixed beta stays algo.kl_coef (no per-row copy); a step without a KL (critic warmup
    with the KL in the loss) leaves beta where it was."""
    cfg = load_config(RunConfig, None, ["algo.kl_coef=0.1"])
    exp = _exp()
    set_kl_loss_coef(exp, cfg, FixedKLController(0.1))
    assert exp.kl_coefs is None
    ctl = AdaptiveKLController(0.1, 0.05, 100)
    stats: dict[str, float] = {}
    adapt_kl(exp, cfg, ctl, stats)
    assert stats == {} and ctl.value == 0.1


def test_a_split_episode_returns_its_whole_kl():
    """Episode 0 is split into rows 0 (a segment) and 1 (its last row), episode 1 is row 2;
    one group, k1, beta 0.5. d: row 0 [0.2, 0.4] (K 0.6), row 1 [1.0] (K 1.0), row 2
    [0.4, 0.2] (K 0.6). Rewards before the fold: [-0.1, 0.8], [-0.5 + 1, 0], [-0.2, -0.1];
    the fold puts -0.5 * 0.6 on row 1's last token: [0.2, 0] = 1 - 0.5 * 1.6. Dr.GRPO over the
    two episodes' returns 0.2 and -0.3 (mean -0.05): A = 0.25 on episode 0's rows, -0.25."""
    samples = [
        Sample(0, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", 0),
        Sample(1, [1, 2], [3], [-0.1], [0], "eos", 0),
        Sample(2, [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "eos", 0),
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    exp.scores = torch.tensor([1.0, 1.0, 0.0])
    exp.old_logprobs = torch.tensor([[-1.0, -1.0], [-0.5, 0.0], [-1.0, -1.0]])
    exp.ref_logprobs = torch.tensor([[-1.2, -1.4], [-1.5, 0.0], [-1.4, -1.2]])
    cfg = load_config(RunConfig, None, ["algo.kl_in=reward", "algo.kl_coef=0.5"])
    cfg.algo.advantage = "drgrpo"
    rewards = kl_shaped_rewards(exp, cfg, FixedKLController(0.5), [0, 0, 1])
    expected = torch.tensor([[-0.1, 0.8], [0.2, 0.0], [-0.2, -0.1]])
    torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=0)
    adv, _ = compute_advantages(
        "drgrpo",
        token_rewards=rewards,
        response_mask=exp.response_mask,
        group_index=exp.group_index,
        episode_index=[0, 0, 1],
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.25, 0.25, -0.25]), atol=1e-6, rtol=0)
    # REINFORCE++ runs its return-to-go along the episode's rows: no fold, the score on the
    # episode's last row only
    cfg.algo.advantage = "reinforce_plus_plus"
    plain = kl_shaped_rewards(exp, cfg, FixedKLController(0.5), [0, 0, 1])
    torch.testing.assert_close(plain[0], torch.tensor([-0.1, -0.2]), atol=1e-6, rtol=0)
    torch.testing.assert_close(plain[1], torch.tensor([0.5, 0.0]), atol=1e-6, rtol=0)

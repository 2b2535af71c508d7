"""``algo.kl_in`` and ``algo.missing_eos_penalty`` in real training runs on a tiny model, each
step checked against a hand computation from what it recorded:

- GRPO with the KL in the reward: R_i = score_i - beta * sum_t (log pi_old - log pi_ref) (k1)
  is what the group normalises, A_i = (R_i - mean_g R) / (std_g R + 1e-6); beta adapts to the
  token mean of that KL (``kl_in_reward``);
- PPO with the KL in the loss: the token rewards carry the score alone (GAE with beta = 0),
  the actor reports ``actor/kl`` and an adaptive beta follows it and reaches the actor;
- a truncated response (finish reason ``length``) trains on score - penalty.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_ppo_step_probes import _hand_gae

import relayrl.controller.algorithms as algorithms
from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model


def digit_reward(prompt: str, completion: str, sample: dict) -> float:
    """The fraction of the completion's characters that are digits (dense, nonzero)."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("klin") / "m", hidden_size=32, seed=1)


def _run(model, tmp_path, monkeypatch, step_name: str, *overrides: str) -> list[dict]:
    """2 steps; per step the experience, the beta it started with and its stats."""
    cfg = run_config(
        model,
        tmp_path / "run",
        "algo.prompts_per_step=2",
        "optim.lr=1e-2",
        "reward.fn=test_kl_placement_train:digit_reward",
        "rollout.max_tokens=8",
        "data.eval_size=2",
        "train.steps=2",
        "train.save_every=0",
        *overrides,
    )
    steps: list[dict] = []
    step_fn = getattr(algorithms, step_name)

    def recording(roles, cfg, schedule, step, kl_ctl):
        beta = float(kl_ctl.value)
        exp, stats = step_fn(roles, cfg, schedule, step, kl_ctl)
        steps.append({"exp": exp, "beta": beta, "stats": stats})
        return exp, stats

    monkeypatch.setattr(algorithms, step_name, recording)
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert len(steps) == 2
    return steps


def _hand_grpo(returns: list[float], groups: list[int]) -> list[float]:
    out = []
    for r, g in zip(returns, groups, strict=True):
        mates = [x for x, h in zip(returns, groups, strict=True) if h == g]
        mean = sum(mates) / len(mates)
        std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (len(mates) - 1))
        out.append(0.0 if std == 0 else (r - mean) / (std + 1e-6))
    return out


def _adapted(beta: float, kl: float, target: float, rows: int, horizon: int) -> float:
    return beta * (1 + min(max(kl / target - 1, -0.2), 0.2) * rows / horizon)


def test_grpo_with_the_kl_in_the_reward(tiny, tmp_path, monkeypatch):
    steps = _run(
        tiny,
        tmp_path,
        monkeypatch,
        "grpo_step",
        "algo.group_size=4",
        "algo.kl_in=reward",
        "algo.kl_coef=0.5",
        "algo.adaptive_kl_target=0.01",
        "algo.adaptive_kl_horizon=100",
    )
    moved = False
    for rec in steps:
        exp, stats, beta = rec["exp"], rec["stats"], rec["beta"]
        mask = exp.response_mask.bool()
        d = (exp.old_logprobs - exp.ref_logprobs).double()
        kl_sums = [float(d[b][mask[b]].sum()) for b in range(len(exp))]
        returns = [float(s) - beta * k for s, k in zip(exp.scores, kl_sums, strict=True)]
        hand = _hand_grpo(returns, exp.group_index.tolist())
        for b in range(len(exp)):
            assert exp.advantages[b][mask[b]].double() == pytest.approx(hand[b], abs=1e-4)
        token_mean = float(d[mask].mean())
        assert stats["kl_in_reward"] == pytest.approx(token_mean, abs=1e-6)
        assert stats["kl_beta"] == pytest.approx(_adapted(beta, token_mean, 0.01, len(exp), 100))
        assert "actor/kl" not in stats and exp.kl_coefs is None  # no KL in the loss
        moved |= max(abs(k) for k in kl_sums) > 1e-3
    assert moved  # step 1's actor had left the reference: the KL shaped the returns
    assert steps[1]["beta"] == steps[0]["stats"]["kl_beta"]


def test_ppo_with_the_kl_in_the_loss(tiny, tmp_path, monkeypatch):
    steps = _run(
        tiny,
        tmp_path,
        monkeypatch,
        "ppo_step",
        "algo.name=ppo",
        "algo.group_size=1",
        "algo.prompts_per_step=8",
        "algo.kl_in=loss",
        "algo.kl_coef=0.5",
        "algo.adaptive_kl_target=0.01",
        "algo.adaptive_kl_horizon=100",
        "algo.gamma=0.9",
        "algo.lam=0.8",
        "algo.recompute_old_logprobs=always",  # pi_old recorded for the hand computation
    )
    for rec in steps:
        exp, stats, beta = rec["exp"], rec["stats"], rec["beta"]
        adv, ret = _hand_gae(exp, 0.0, "k1", gamma=0.9, lam=0.8)  # the score alone
        assert torch.allclose(exp.advantages.double(), adv, atol=1e-5)
        assert torch.allclose(exp.returns.double(), ret, atol=1e-5)
        assert exp.kl is None and "kl_in_reward" not in stats
        assert exp.kl_coefs is not None and torch.all(exp.kl_coefs == torch.tensor(beta))
        kl = stats["actor/kl"]
        assert stats["kl_beta"] == pytest.approx(_adapted(beta, kl, 0.01, len(exp), 100))
    assert steps[1]["stats"]["actor/kl"] > 0  # the loss term met a policy off the reference
    assert steps[1]["beta"] == steps[0]["stats"]["kl_beta"]


def test_truncated_responses_train_on_a_penalised_score(sft_model, tmp_path, monkeypatch):
    """The SFT-warmed model answers in a few tokens then EOS: 3 tokens cut its longer answers."""
    steps = _run(
        sft_model,
        tmp_path,
        monkeypatch,
        "grpo_step",
        "algo.group_size=4",
        "algo.missing_eos_penalty=0.5",
        "rollout.max_tokens=3",
    )
    for rec in steps:
        exp, stats = rec["exp"], rec["stats"]
        cut = [s.finish_reason == "length" for s in exp.samples]
        assert stats["missing_eos/penalised"] == sum(cut)
        raw = exp.outcomes.tolist()  # the reward function's scores (no reward service)
        expected = [r - 0.5 if c else r for r, c in zip(raw, cut, strict=True)]
        assert exp.scores.tolist() == pytest.approx(expected)
        hand = _hand_grpo(expected, exp.group_index.tolist())
        mask = exp.response_mask.bool()
        for b in range(len(exp)):
            assert exp.advantages[b][mask[b]].double() == pytest.approx(hand[b], abs=1e-4)
    cut_counts = [rec["stats"]["missing_eos/penalised"] for rec in steps]
    assert 0 < sum(cut_counts) < 16  # both kinds of answer met (a real test of the split)

"""PPO-RLHF's step on a tiny model, checked against hand computation from what the step
recorded: token rewards r_t = -beta * KL_t (``algo.kl_estimator``, k1 / k3 of
pi_old vs pi_ref) plus the score on the last valid token; GAE(gamma, lambda) over valid
tokens with V = 0 past the last one (a response ends its episode); returns R = A + V; the
advantages whitened over valid tokens only; 0 at masked positions. The reference is frozen
(its weights never change while the actor's do), and ``algo.critic_warmup_steps`` trains the
critic alone for its first steps."""

from __future__ import annotations

import math

import pytest
import torch

import relayrl.controller.algorithms as algorithms
from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model


def digit_reward(prompt: str, completion: str, sample: dict) -> float:
    """The fraction of the completion's characters that are digits (dense, nonzero)."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    after = model.state_dict()
    return any(not torch.equal(v, after[k]) for k, v in before.items())


def _run(tmp_path, monkeypatch, *overrides: str) -> list[dict]:
    """3 PPO steps; per step the experience, the beta it used and which roles' weights
    changed during it."""
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    cfg = run_config(
        model,
        tmp_path / "run",
        "algo.name=ppo",
        "algo.group_size=1",
        "algo.prompts_per_step=8",
        "algo.kl_coef=0.1",
        "algo.gamma=0.9",
        "algo.lam=0.8",
        "optim.lr=1e-2",
        "reward.fn=test_ppo_step_probes:digit_reward",
        "rollout.max_tokens=16",
        "data.eval_size=2",
        "train.steps=3",
        "train.save_every=0",
        *overrides,
    )
    steps: list[dict] = []
    ppo_step = algorithms.ppo_step

    def recording(roles, cfg, schedule, step, kl_ctl):
        before = {
            "reference": _weights(roles.reference.model),
            "actor": _weights(roles.actor.model),
            "critic": _weights(roles.critic.model),
        }
        beta = float(kl_ctl.value)
        exp, stats = ppo_step(roles, cfg, schedule, step, kl_ctl)
        changed = {
            "reference": _changed(before["reference"], roles.reference.model),
            "actor": _changed(before["actor"], roles.actor.model),
            "critic": _changed(before["critic"], roles.critic.model),
        }
        steps.append({"exp": exp, "beta": beta, "changed": changed, "stats": stats})
        return exp, stats

    monkeypatch.setattr(algorithms, "ppo_step", recording)
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    assert len(steps) == 3
    return steps


def _hand_gae(exp, beta: float, kind: str, gamma: float, lam: float):
    """Plain-Python GAE over each row's valid tokens, then whitening over all of them."""
    mask = exp.response_mask.bool()
    rows, length = mask.shape
    raw = [[0.0] * length for _ in range(rows)]
    for b in range(rows):
        valid = [t for t in range(length) if mask[b, t]]
        reward = {}
        for t in valid:
            d = float(exp.old_logprobs[b, t]) - float(exp.ref_logprobs[b, t])
            kl = d if kind == "k1" else math.exp(-d) + d - 1
            reward[t] = -beta * kl
        reward[valid[-1]] += float(exp.scores[b])
        next_v, next_a = 0.0, 0.0  # the response ends the episode: nothing to bootstrap
        for t in reversed(valid):
            v = float(exp.values[b, t])
            next_a = reward[t] + gamma * next_v - v + gamma * lam * next_a
            raw[b][t], next_v = next_a, v
    flat = [raw[b][t] for b in range(rows) for t in range(length) if mask[b, t]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    whitened = [
        [(raw[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0 for t in range(length)]
        for b in range(rows)
    ]
    returns = [
        [raw[b][t] + float(exp.values[b, t]) if mask[b, t] else 0.0 for t in range(length)]
        for b in range(rows)
    ]
    return torch.tensor(whitened, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_ppo_step_advantages_match_a_hand_computation(tmp_path, monkeypatch, kind):
    steps = _run(tmp_path, monkeypatch, f"algo.kl_estimator={kind}")
    kl_seen, padded = False, False
    for rec in steps:
        exp = rec["exp"]
        mask = exp.response_mask.bool()
        adv, ret = _hand_gae(exp, rec["beta"], kind, gamma=0.9, lam=0.8)
        assert torch.allclose(exp.advantages.double(), adv, atol=1e-5)
        assert torch.allclose(exp.returns.double(), ret, atol=1e-5)
        assert not exp.advantages[~mask].any() and not exp.values[~mask].any()
        kl_seen |= bool((exp.old_logprobs - exp.ref_logprobs)[mask].abs().max() > 1e-4)
        padded |= not bool(mask.all())
    assert kl_seen  # the actor moved away from the reference: the KL term was exercised
    assert padded  # a response ended (EOS) before max_tokens: its padding was masked out
    assert all(not rec["changed"]["reference"] for rec in steps)
    assert all(rec["changed"]["actor"] and rec["changed"]["critic"] for rec in steps)


def test_critic_warmup_trains_the_critic_alone_first(tmp_path, monkeypatch):
    steps = _run(tmp_path, monkeypatch, "algo.critic_warmup_steps=2")
    assert [rec["changed"]["actor"] for rec in steps] == [False, False, True]
    assert all(rec["changed"]["critic"] for rec in steps)
    assert [rec["stats"]["critic_warmup"] for rec in steps] == [1.0, 1.0, 0.0]
    assert all(not rec["changed"]["reference"] for rec in steps)


def test_critic_warmup_needs_a_critic():
    from relayrl.config import AlgoConfig

    with pytest.raises(ValueError, match="critic_warmup_steps"):
        AlgoConfig(name="grpo", group_size=2, critic_warmup_steps=1)

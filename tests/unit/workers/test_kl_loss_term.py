"""The actor's KL loss term wherever ``algo.kl_in: loss`` puts it (GRPO's default, PPO on
request): loss = policy loss + beta * agg(k3(log pi - log pi_ref)), beta the step's
``Experience.kl_coefs`` (an adaptive controller's) or ``algo.kl_coef``; none with the KL in
the reward. The advantages are 0, so the policy loss is exactly 0 and the reported loss is the
KL term alone: with log pi - log pi_ref = 0.5 on every token,
k3 = exp(-0.5) + 0.5 - 1 = 0.1065307 nats per token (token-mean: the same)."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.config import RunConfig, load_config
from relayrl.model import build_tiny_model
from relayrl.model.loading import load_causal_lm
from relayrl.rollout.types import Sample
from relayrl.workers import ActorWorker, Experience

K3 = math.exp(-0.5) + 0.5 - 1  # 0.1065307


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kl") / "m", hidden_size=32, seed=1)


def _update(model_dir, overrides: list[str], kl_coefs: float | None = None) -> dict[str, float]:
    algo = load_config(
        RunConfig,
        None,
        [
            "algo.group_size=3",
            "algo.prompts_per_step=1",
            "algo.mini_batches=1",
            "algo.skip_zero_advantage=false",  # every row through the forward (A = 0 here)
            *overrides,
        ],
    ).algo
    optim = load_config(RunConfig, None, []).optim
    actor = ActorWorker(load_causal_lm(model_dir), algo, optim, 6, seed=0)
    samples = [
        Sample(i, [1, 2, 3], [5, 6, 7, 8, 9, 10][:n], [-0.5] * n, [0] * n, "eos", i)
        for i, n in enumerate([6, 3, 4])
    ]
    exp = Experience.from_samples(samples, pad_id=0)
    mask = exp.response_mask
    exp.ref_logprobs = (actor.compute_logprobs(exp) - 0.5) * mask  # d = 0.5 on every token
    exp.advantages = torch.zeros_like(mask)
    if kl_coefs is not None:
        exp.kl_coefs = torch.full((len(exp),), kl_coefs)
    return actor.update(exp)


@pytest.mark.parametrize(
    "overrides", [["algo.name=ppo", "algo.kl_in=loss"], ["algo.name=grpo"]], ids=["ppo", "grpo"]
)
def test_kl_loss_term_is_beta_times_the_token_mean_k3(model_dir, overrides):
    out = _update(model_dir, [*overrides, "algo.kl_coef=0.2"])
    assert out["actor/kl"] == pytest.approx(K3, abs=1e-5)
    assert out["actor/loss"] == pytest.approx(0.2 * K3, abs=1e-5)  # 0.0213061


def test_the_steps_beta_replaces_kl_coef(model_dir):
    """An adaptive controller's beta (0.4) reaches the loss through ``kl_coefs``."""
    out = _update(model_dir, ["algo.name=ppo", "algo.kl_in=loss", "algo.kl_coef=0.2"], 0.4)
    assert out["actor/loss"] == pytest.approx(0.4 * K3, abs=1e-5)  # 0.0426123


@pytest.mark.parametrize(
    "overrides", [["algo.name=ppo"], ["algo.name=grpo", "algo.kl_in=reward"]], ids=["ppo", "grpo"]
)
def test_a_kl_in_the_reward_puts_none_in_the_loss(model_dir, overrides):
    out = _update(model_dir, [*overrides, "algo.kl_coef=0.2"])
    assert "actor/kl" not in out
    assert out["actor/loss"] == 0.0


def test_rows_without_advantage_still_train_the_kl_loss_term(model_dir):
    """``skip_zero_advantage`` (on) must not drop rows whose loss still has the KL term."""
    overrides = ["algo.name=ppo", "algo.kl_in=loss", "algo.kl_coef=0.2"]
    out = _update(model_dir, [*overrides, "algo.skip_zero_advantage=true"])
    assert out["actor/zero_adv_skipped_frac"] == 0.0
    assert out["actor/loss"] == pytest.approx(0.2 * K3, abs=1e-5)

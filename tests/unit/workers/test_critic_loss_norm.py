"""The critic's loss aggregation: Dr.GRPO's constant is the actor's."""

from __future__ import annotations

import pytest

from relayrl.model import build_tiny_model
from scale_helpers import scale_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("critic_norm") / "m", hidden_size=16)


def test_the_critic_takes_the_actors_dr_grpo_constant(model_dir):
    """Under ``seq-mean-token-sum-norm`` the value loss is sum(l*m) / (seqs * L) with L the
    run's ``rollout.max_tokens``, the actor's constant: L times smaller than
    ``seq-mean-token-sum``'s sum(l*m) / seqs on the same batch (one optimizer step, so the
    loss is read before the weights move)."""
    from fsdp_ranks import critic_experience
    from relayrl.workers.build import build_critic

    losses = {}
    for agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        opts = ("algo.name=ppo", "algo.mini_batches=1", f"algo.loss_agg={agg}")
        cfg = scale_config(model_dir, *opts, "rollout.max_tokens=8")
        critic = build_critic(cfg, str(model_dir))
        assert critic.max_response_tokens == 8
        exp = critic_experience(model_dir)
        exp.values, exp.returns = exp.values.float(), exp.returns.float()
        losses[agg] = critic.update(exp)["critic/vf_loss"]
    assert losses["seq-mean-token-sum-norm"] == pytest.approx(losses["seq-mean-token-sum"] / 8)

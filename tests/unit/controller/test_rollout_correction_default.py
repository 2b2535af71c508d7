"""Off the sync schedule the 2025 losses (gspo, cispo, sapo, gmpo, ...) get decoupled PPO's
behaviour weight by default ("off-policy correction is on whenever data can be stale"), and a
configured ``algo.rollout_correction`` replaces it, as it does for ``decoupled_ppo``. Weights
checked by hand on a real tiny actor's logprobs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relayrl.config import RunConfig, load_config
from relayrl.controller.offpolicy import correct_rollout, needs_behaviour_weight
from relayrl.model import build_tiny_model
from relayrl.model.batching import pack_batch
from relayrl.workers import Experience
from relayrl.workers.build import build_actor

# behaviour weight w = pi_prox / pi_behav of the 4 response tokens of row 0 and 2 of row 1
W = [[2.0, 10.0, 1.0, 0.5], [4.0, 6.0, 1.0, 1.0]]
LENGTHS = [4, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _cfg(model: Path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, None, [f"model.path={model}", "threads=1", *overrides])


def _case(cfg: RunConfig) -> tuple[dict[str, float], Experience, torch.Tensor]:
    """Two rows whose engine logprobs are the trainer's minus log w (w of ``W``)."""
    actor = build_actor(cfg, cfg.model.path)
    batch = pack_batch([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]], pad_id=0)
    exp = Experience(batch)
    mask = batch.response_mask
    trainer = actor.compute_logprobs(exp)
    exp.behaviour_logprobs = (trainer - torch.tensor(W).log()) * mask
    exp.advantages = torch.ones(mask.shape) * mask
    return correct_rollout(SimpleNamespace(actor=actor), exp, cfg), exp, mask


def _weights(exp: Experience, mask: torch.Tensor) -> list[float]:
    """The weights of the 6 response tokens, row 0 then row 1."""
    w = exp.rollout_weights * mask
    return [x for row, n in zip(w.tolist(), LENGTHS, strict=True) for x in row[:n]]


@pytest.mark.parametrize("loss", ["gspo", "cispo", "sapo", "gmpo", "gspo_token"])
def test_new_losses_get_the_behaviour_weight_off_the_sync_schedule(tiny, loss):
    cfg = _cfg(tiny, "schedule=overlap", f"algo.policy_loss={loss}")
    assert needs_behaviour_weight(cfg)
    stats, exp, mask = _case(cfg)
    # token-mask, cap 5: w = 10 and 6 are masked (0), the others kept as they are
    assert _weights(exp, mask) == pytest.approx([2.0, 0.0, 1.0, 0.5, 4.0, 0.0], rel=1e-4)
    assert stats["offpolicy/capped_frac"] == pytest.approx(2 / 6)
    assert stats["offpolicy/behav_weight_max"] == pytest.approx(10.0, rel=1e-4)
    assert stats["offpolicy/behav_weight_mean"] == pytest.approx(23.5 / 6, rel=1e-4)


def test_behaviour_weight_modes_apply(tiny):
    cfg = _cfg(tiny, "schedule=async", "algo.policy_loss=cispo",
               "algo.behav_weight_mode=sequence-truncate", "algo.behav_weight_cap=2")  # fmt: skip
    _, exp, mask = _case(cfg)
    g0 = math.exp(sum(map(math.log, W[0])) / 4)  # geometric means: 10^(1/4), sqrt(24)
    g1 = math.exp(sum(map(math.log, W[1][:2])) / 2)
    assert _weights(exp, mask) == pytest.approx([min(g0, 2)] * 4 + [min(g1, 2)] * 2, rel=1e-4)


def test_rollout_correction_replaces_it_and_reject_kl_composes(tiny):
    rc = "algo.rollout_correction"
    cfg = _cfg(tiny, "schedule=overlap", "algo.policy_loss=gspo", f"{rc}.mode=tis")
    assert not needs_behaviour_weight(cfg)
    stats, exp, mask = _case(cfg)
    assert _weights(exp, mask) == pytest.approx([2.0, 2.0, 1.0, 0.5, 2.0, 2.0], rel=1e-4)
    assert "offpolicy/capped_frac" not in stats
    # mode none with a KL rejection: behaviour weight times the rejection; row mean of
    # k2 = (log w)^2 / 2: row 0 (0.48 + 5.30 + 0 + 0.48) / 8 = 0.78 kept, row 1 (1.92 +
    # 3.21) / 4 = 1.28 > 1 rejected
    cfg = _cfg(tiny, "schedule=overlap", "algo.policy_loss=gspo", f"{rc}.reject_kl=1.0",
               f"{rc}.kl_estimator=k2")  # fmt: skip
    assert needs_behaviour_weight(cfg)
    _, exp, mask = _case(cfg)
    assert _weights(exp, mask) == pytest.approx([2.0, 0.0, 1.0, 0.5, 0.0, 0.0], rel=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [("algo.policy_loss=gspo",), ("schedule=overlap", "algo.policy_loss=decoupled_ppo"),
     ("schedule=overlap", "algo.policy_loss=ppo"), ("schedule=async",)],
)  # fmt: skip
def test_no_extra_weight_where_the_loss_has_its_own(tiny, overrides):
    """Sync (on-policy), decoupled PPO (weights inside its loss) and naive PPO: none added."""
    cfg = _cfg(tiny, *overrides)
    assert not needs_behaviour_weight(cfg)
    _, exp, _ = _case(cfg)
    assert exp.rollout_weights is None

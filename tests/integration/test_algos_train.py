"""The 2025 losses, the behaviour-weight modes and the rollout correction inside real runs:
selectable by name, in every schedule, with their stats logged; a controlled train /
inference mismatch (the trainer assumes another sampling temperature than the engine's) is
seen by the ``rollout_corr/*`` monitor; each loss trains the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_config
from relayrl.cluster.local import build_local_roles
from relayrl.config import ConfigError, RunConfig, load_config
from relayrl.controller.preflight import check_policy_loss
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model

NEW_LOSSES = ("gspo", "gspo_token", "cispo", "sapo", "gmpo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _small(model: Path, run_dir: Path, *overrides: str):
    return run_config(
        model,
        run_dir,
        "train.steps=2",
        "algo.prompts_per_step=4",
        "algo.group_size=4",
        "algo.mini_batches=1",
        "data.eval_size=8",
        "rollout.max_tokens=4",
        "algo.skip_zero_advantage=false",  # an untrained model scores 0: train every row
        *overrides,
    )


def _train(cfg: RunConfig, trainer_temperature: float | None = None) -> dict:
    """Train; with ``trainer_temperature`` the actor and reference assume that temperature
    while the engine samples at ``rollout.temperature``: a controlled mismatch."""

    def build(actor: str, critic: str | None):
        roles = build_local_roles(cfg, actor, critic)
        if trainer_temperature is not None:
            roles.actor.temperature = trainer_temperature
            if roles.reference is not None:
                roles.reference.temperature = trainer_temperature
        return roles

    return train(cfg, build)


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "actor/loss" in r]


@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_each_new_loss_runs_by_name_with_rollout_correction(tiny, tmp_path, loss):
    cfg = _small(
        tiny,
        tmp_path / loss,
        f"algo.policy_loss={loss}",
        "algo.loss_agg=seq-mean-token-mean",
        "algo.rollout_correction.mode=tis",
    )
    out = _train(cfg)
    recs = _records(tmp_path / loss)
    assert len(recs) == 2
    for key in ("actor/clipfrac", "actor/approx_kl", "rollout_corr/weight_mean",
                "rollout_corr/affected_frac", "rollout_corr/logp_diff_abs_max"):  # fmt: skip
        assert key in out, key
    # sync, same weights, same temperature: engine and trainer agree to numerical noise
    assert out["rollout_corr/logp_diff_abs_max"] < 1e-3
    assert out["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    "schedule, overrides",
    [
        pytest.param(
            "overlap",
            ("algo.policy_loss=gspo", "algo.rollout_correction.mode=mis"),
            marks=pytest.mark.slow,  # ~16 s; the async case covers the off-policy path
        ),
        (
            "async",
            (
                "algo.behav_weight_mode=sequence-truncate",
                "algo.loss_agg=token-sum",
                "algo.rollout_correction.mode=icepop",
            ),
        ),  # fmt: skip
        ("async", ("algo.policy_loss=sapo",)),  # the behaviour weight by default
    ],
)
def test_off_policy_schedules_take_the_new_options(tiny, tmp_path, schedule, overrides):
    cfg = _small(tiny, tmp_path / schedule, f"schedule={schedule}", *overrides)
    out = _train(cfg)
    if cfg.algo.rollout_correction.enabled:
        assert "rollout_corr/affected_frac" in out, out
    if cfg.policy_loss == "decoupled_ppo":
        assert "actor/pg_capped_frac" in out, out
    else:  # a 2025 loss: decoupled PPO's weight from the controller unless a mode replaces it
        default = cfg.algo.rollout_correction.mode == "none"
        assert ("offpolicy/capped_frac" in out) == default, out


def test_controlled_mismatch_is_seen_and_corrected(tiny, tmp_path):
    # the engine samples at T = 1, the trainer computes logprobs at T = 1.3
    # (the untrained tiny model is nearly uniform, so the gap is small: a narrow band)
    rc = "algo.rollout_correction"
    common = ("rollout.temperature=1.0", f"{rc}.mode=icepop", f"{rc}.lower=0.99",
              f"{rc}.upper=1.01", f"{rc}.mismatch_threshold=0.005")  # fmt: skip
    out = _train(_small(tiny, tmp_path / "mm", *common), trainer_temperature=1.3)
    assert out["rollout_corr/logp_diff_abs_mean"] > 0.005
    assert out["rollout_corr/affected_frac"] > 0.2
    assert out["rollout_corr/beyond_threshold_frac"] > 0.2
    assert out["rollout_corr/weight_mean"] < 0.8  # the masked tokens weigh 0
    same = _train(_small(tiny, tmp_path / "same", *common))
    assert same["rollout_corr/logp_diff_abs_mean"] < 1e-4
    assert same["rollout_corr/affected_frac"] == 0.0


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["algo.policy_loss=cispo", "algo.dual_clip=3"])
    assert str(err.value) == (
        "command line: bad value for 'algo.dual_clip' (3.0): "
        "dual clip is not defined for policy_loss 'cispo'"
    )
    with pytest.raises(ConfigError) as err:
        load_config(
            RunConfig,
            None,
            ["algo.rollout_correction.mode=icepop", "algo.rollout_correction.level=sequence"],
        )
    assert str(err.value) == (
        "command line: bad value for 'algo.rollout_correction.level' ('sequence'): "
        "icepop masks tokens: use level token"
    )
    # a loss name is checked against the registry before the run starts (a run's own module
    # may register one: tests/integration/test_algos_loss_in_one_module.py); a non-name still here
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["algo.policy_loss=gp-g"])
    assert str(err.value).startswith("command line: bad value for 'algo.policy_loss' ('gp-g'):")
    cfg = load_config(RunConfig, None, ["algo.policy_loss=gpg"])
    with pytest.raises(ConfigError, match=r"^unknown algo.policy_loss 'gpg'; registered: cispo"):
        check_policy_loss(cfg)

"""The first hour, second round (issue 44): each defect a user met on their own model, as the
one line and exit code ``relayrl`` ends with. Resume that refuses what it cannot continue,
checkpoint faults that name the intact checkpoint, corrupt files, a busy port, SFT under the
run-directory rules and in RL's prompt format, the reward function's return contract."""

from __future__ import annotations

import pytest

from relayrl.cli import main
from relayrl.model import build_tiny_model
from tiny_runs import file_hashes, train_argv, write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


@pytest.fixture
def finished(tiny, tmp_path, capsys):
    """A finished 2-step run (checkpoints at steps 1 and 2) and its config file."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    assert main(train_argv(config, "train.steps=2", "train.save_every=1")) == 0
    capsys.readouterr()
    return run, config


def _run(capsys, argv):
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


# ---- --resume refuses what it cannot continue ---------------------------------------------
def test_resume_of_a_missing_or_empty_run_directory_is_refused(tiny, tmp_path, capsys):
    for run, why in ((tmp_path / "typo", "does not exist"), (tmp_path / "empty", "holds no run")):
        if why == "holds no run":
            run.mkdir()
        config = write_config(tmp_path / "run.yaml", tiny, run)
        rc, err = _run(capsys, train_argv(config, "train.steps=2", flags=("--resume",)))
        assert rc == 2
        assert err == (
            f"relayrl train: error: --resume: run directory {run} {why}: no checkpoint to "
            f"continue (looked for {run}/checkpoints/step_*/trainer_state.pt); check "
            "run_dir=..., or start a new run without --resume"
        )
    assert not (tmp_path / "typo").exists()
    assert [p.name for p in (tmp_path / "empty").iterdir()] in ([], [".lock"])


def test_resume_with_another_model_or_algorithm_is_refused_unless_allowed(
    finished, tiny, tmp_path, capsys
):
    run, config = finished
    other = build_tiny_model(tmp_path / "other", hidden_size=16)
    before = file_hashes(run)
    rc, err = _run(
        capsys,
        train_argv(
            config,
            "train.steps=3",
            f"model.path={other}",
            "algo.name=ppo",
            "data.source.chat_template=false",
            flags=("--resume",),
        ),
    )
    assert rc == 2
    assert err == (
        f"relayrl train: error: --resume: the config changes what the run in {run} was trained "
        f"with: model.path ('{tiny}' -> '{other}'), algo.name ('grpo' -> 'ppo'), "
        "data.source.chat_template (True -> False); start a new run (run_dir=... or "
        "--overwrite), or pass --allow-config-change to continue with the change"
    )
    assert file_hashes(run) == before
    rc = main(
        train_argv(
            config,
            "train.steps=3",
            "algo.name=ppo",
            flags=("--resume", "--allow-config-change"),
        )
    )
    assert rc == 0
    assert "name: ppo" in (run / "config.yaml").read_text()

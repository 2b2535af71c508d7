"""The first hour (issue 44), the reward function's contract: a dict without a score, an
exception and a hang each end the run in one line (issue 43's budget of infrastructure
failures); the last completed step is checkpointed, and resume continues once it is fixed."""

from __future__ import annotations

import sys
import time

import pytest

from relayrl.cli import main
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from tiny_runs import run_cli, train_argv, write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


# ---- the reward function's contract; a reward exception saves the last completed step -------
REWARDS = """
CALLS = {"n": 0}

def no_score(prompt, completion, sample):
    return {"reward": 0.78, "exact": 0.75}

def explodes(prompt, completion, sample):
    CALLS["n"] += 1
    if CALLS["n"] > 10:  # 2 eval prompts, then 4 answers a step: step 3 fails
        return 1 / 0
    return {"score": 0.5, "length": float(len(completion))}
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    name = f"rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_reward_dict_without_a_score_is_one_line(tiny, tmp_path, rewards_module, capsys):
    config = write_config(tmp_path / "run.yaml", tiny, tmp_path / "run")
    rc, err = run_cli(
        capsys, train_argv(config, "train.steps=2", f"reward.fn={rewards_module}:no_score")
    )
    assert rc == 1
    assert err == (  # an infrastructure failure of every sample (issue 43's budget): one line
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {rewards_module}:no_score "
        "returned {'reward': 0.78, 'exact': 0.75}: a dict needs a 'score' (the reward; other "
        "keys are logged components, never summed) (step 1); no checkpoint was written"
    )


def test_a_reward_exception_checkpoints_the_last_completed_step(
    tiny, tmp_path, rewards_module, capsys
):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    fn = f"reward.fn={rewards_module}:explodes"
    rc, err = run_cli(capsys, train_argv(config, "train.steps=5", fn))  # save_every: 0
    assert rc == 1
    assert err == (
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {rewards_module}:explodes raised "
        f"ZeroDivisionError: division by zero (step 3); checkpoint {run}/checkpoints/"
        "step_000002 written; continue with --resume"
    )
    logged = [r for r in read_metrics(run) if "reward_mean" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert logged[0]["reward/length"] >= 0  # a named component, logged as a metric
    assert logged[0]["reward_mean"] == 0.5  # the score, not score + components
    sys.modules[rewards_module].CALLS["n"] = -(10**6)  # fixed: resume trains steps 3-5
    assert main(train_argv(config, "train.steps=5", fn, flags=("--resume",))) == 0
    assert [r["step"] for r in read_metrics(run) if "reward_mean" in r] == [1, 2, 3, 4, 5]


HANGS = """
import time

CALLS = {"n": 0}

def hangs(prompt, completion, sample):
    CALLS["n"] += 1
    if CALLS["n"] > 6:  # 2 eval prompts, 4 answers of step 1: step 2 hangs
        time.sleep(30)
    return 0.0
"""


def test_a_reward_function_that_hangs_times_out_in_one_line(tiny, tmp_path, capsys, monkeypatch):
    name = f"hangs_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    t0 = time.monotonic()
    rc, err = run_cli(
        capsys,
        train_argv(
            config,
            "train.steps=4",
            f"reward.fn={name}:hangs",
            "reward.fn_timeout_s=1",
        ),
    )
    assert rc == 1
    assert time.monotonic() - t0 < 20
    assert err == (
        "relayrl train: error: no sample of the step is left to train: infrastructure failures, "
        f"mostly reward_fn (4 of 4); last error: reward function {name}:hangs did not return "
        "within 1 s "
        f"(reward.fn_timeout_s) (step 2); checkpoint {run}/checkpoints/step_000001 written; "
        "continue with --resume"
    )

"""Bad input: each case exits non-zero (2) with a one-line message naming the problem."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relayrl.cli import main
from relayrl.config import ConfigError
from relayrl.model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _run(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def test_missing_model_directory(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path / 'no_such_model'}\n")
    rc, err = _run(capsys, ["train", str(cfg)])
    assert rc == 2
    assert (
        len(err.splitlines()) == 1 and "model directory not found" in err and "no_such_model" in err
    )


def test_unknown_config_key(capsys, tmp_path, tiny):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny}\nalgo:\n  klcoef: 0.1\n")
    rc, err = _run(capsys, ["train", str(cfg)])
    assert rc == 2 and len(err.splitlines()) == 1
    assert "unknown config key 'algo.klcoef'" in err and "run.yaml" in err


def test_wrong_type_override(capsys, tmp_path, tiny):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model_path: {tiny}\n")
    rc, err = _run(capsys, ["sft", str(cfg), "steps=many"])
    assert rc == 2 and len(err.splitlines()) == 1 and "'steps'" in err


def test_missing_config_file(capsys, tmp_path):
    rc, err = _run(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert rc == 2 and "config file not found" in err


def test_malformed_jsonl_line(capsys, tmp_path, tiny):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 1+1\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"model:\n  path: {tiny}\ndata:\n  task: jsonl\n  train_path: {data}\n"
        f"  eval_path: {data}\nlogging:\n  progress: false\n"
    )
    rc, err = _run(capsys, ["train", str(cfg), f"run_dir={tmp_path / 'run'}"])
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"{data}:2:" in err


def test_exit_code_and_no_traceback_from_the_real_command(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("schedule: sync\nalgo:\n  group_size: zero\n")
    proc = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "train", str(cfg)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "algo.group_size" in proc.stderr


def test_a_directory_is_not_a_config_file(capsys, tmp_path):
    rc, err = _run(capsys, ["train", f"{tmp_path}/"])
    assert (rc, err) == (2, f"relayrl train: error: {tmp_path}/: is a directory, not a config file")


def test_debug_after_the_subcommand_and_between_overrides_shows_the_traceback(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algo:\n  group_size: zero\n")
    for argv in (
        ["train", str(cfg), "--debug"],
        ["train", str(cfg), "--debug", "train.steps=2"],
        ["--debug", "train", str(cfg)],
    ):
        with pytest.raises(ConfigError, match=r"bad value for 'algo\.group_size' \('zero'\)"):
            main(argv)


def test_debug_after_plan_and_rlhf_subcommands(tmp_path):
    with pytest.raises(ValueError, match="eta must be an integer >= 0 or 'inf', got 'x'"):
        main(["simulate", "--eta", "x", "--debug"])
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"^command line: bad value for 'algo\.kl_coef' \(-1\)"):
        main(["dpo", str(cfg), "algo.kl_coef=-1", "--debug"])


def test_overrides_after_a_flag_are_overrides(capsys, tmp_path):
    """``relayrl train cfg.yaml --resume train.steps=8``: argparse ends the positional
    overrides at the flag; the ones after it are overrides all the same (they used to be
    'unrecognized arguments')."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algo:\n  name: grpo\n")
    rc, err = _run(capsys, ["train", str(cfg), "--resume", "algo.group_size=1"])
    assert rc == 2
    assert err.startswith(
        "relayrl train: error: command line: bad value for 'algo.group_size' (1): "
    )
    with pytest.raises(SystemExit) as exc:
        main(["train", str(cfg), "--resume", "--bogus"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err

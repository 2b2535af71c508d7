"""The first hour (issue 44), the command line's front door: a typo on the command line or in
the config file is one line before torch loads, and the README's first-run commands (train,
eval, report, serve) run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.model import build_tiny_model
from tiny_runs import TINY_RUN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


@pytest.mark.parametrize("command", ["train", "sft", "eval", "filter"])
def test_a_config_typo_is_reported_before_torch_is_imported(tmp_path, command):
    """The one line of a typo came after 6-20 s of imports; now before torch loads."""
    config = tmp_path / "run.yaml"
    config.write_text("seed: 0\n")
    extra = ["--output", str(tmp_path / "o.jsonl")] if command == "filter" else []
    code = (
        "import sys\nfrom relayrl.cli import main\n"
        f"rc = main({[command, str(config), 'no_such_key=1', *extra]!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"relayrl {command}: error: command line: unknown config key 'no_such_key'"
    )


def test_a_typo_in_the_config_file_is_reported_before_torch_and_transformers_load(tmp_path):
    """``relayrl train bad.yaml``: the file's line, and neither torch nor transformers loaded."""
    config = tmp_path / "bad.yaml"
    config.write_text("seed: 0\nalgo:\n  kl_cof: 0.1\n")
    code = (
        "import sys\nfrom relayrl.cli import main\n"
        f"rc = main(['train', {str(config)!r}])\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'torch was imported'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip() == f"relayrl train: error: {config}:3: unknown config key 'algo.kl_cof'"
    )


def _readme_first_run_commands() -> list[list[str]]:
    """The README's "A first run on your own model" code block, one argv per command (the
    ``relayrl`` dropped, continuation lines joined, comments cut)."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("## A first run on your own model")[1].split("```bash\n")[1]
    block = block.split("```")[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.strip()]


def test_the_readmes_path_from_trained_to_evaluated_and_served_runs(
    tiny, tmp_path, capsys, monkeypatch
):
    """The README's commands as written: train, then evaluate, report and serve the trained
    checkpoint (the model, data, step numbers and sizes swapped for the tiny ones)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, completion, sample):\n"
        "    return float(completion.strip() == sample['answer'])\n"
    )
    swap = {  # substrings of the README's arguments
        "/models/qwen2-0.5b": str(tiny),
        "configs/grpo_jsonl.yaml": str(root / "configs/grpo_jsonl.yaml"),
        "my.jsonl": str(root / "examples/arithmetic_prompts.jsonl"),
        "step_000200": "step_000002",
    }
    extra = {
        "train": [*TINY_RUN, "train.steps=2", "train.save_every=1"],
        "eval": TINY_RUN,
        "serve": ["--seconds", "0.1"],
    }
    commands = _readme_first_run_commands()
    assert [argv[0] for argv in commands] == ["train", "eval", "report", "serve"]
    for argv in commands:
        for old, new in swap.items():
            argv = [a.replace(old, new) for a in argv]
        argv = ["0" if a == "8000" else a for a in argv]  # any free port
        assert main([*argv, *extra.get(argv[0], [])]) == 0, (argv, capsys.readouterr().err)
    out = capsys.readouterr().out
    actor = "runs/my_grpo/checkpoints/step_000002/actor"
    assert f"serving {actor} as 'actor' at http://127.0.0.1:" in out
    assert "pass@8" in out and (tmp_path / actor / "model.safetensors").is_file()

"""The CLI commands end to end on a tiny model: sft -> train -> eval -> train --resume."""

from __future__ import annotations

import json

from relayrl.cli import main
from relayrl.model import build_tiny_model


def test_sft_train_eval_resume(tmp_path, capsys):
    base = build_tiny_model(tmp_path / "base", hidden_size=32)
    sft_cfg = tmp_path / "sft.yaml"
    sft_cfg.write_text(
        f"model_path: {base}\noutput_dir: {tmp_path / 'sft'}\nsteps: 20\nthreads: 1\n"
        "progress: false\n"
    )
    assert main(["sft", str(sft_cfg), "batch_size=16"]) == 0
    assert (tmp_path / "sft" / "config.json").is_file()

    run_cfg = tmp_path / "run.yaml"
    run_cfg.write_text(
        f"model:\n  path: {tmp_path / 'sft'}\nrun_dir: {tmp_path / 'run'}\nthreads: 1\n"
        "algo:\n  prompts_per_step: 4\n  group_size: 2\ndata:\n  eval_size: 8\n"
        "train:\n  steps: 2\n  save_every: 1\nlogging:\n  progress: false\n"
    )
    assert main(["train", str(run_cfg)]) == 0
    out = capsys.readouterr().out
    assert "eval pass rate: before" in out
    assert main(["eval", str(run_cfg)]) == 0
    assert "greedy pass rate on 8 held-out prompts" in capsys.readouterr().out
    assert main(["train", str(run_cfg), "train.steps=3", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]  # each step once
    assert sum("eval/pass_rate" in r for r in rows) == 3  # before, end of first run, end
    assert (tmp_path / "run" / "tb").is_dir()
    assert (tmp_path / "run" / "timeline.json").is_file()

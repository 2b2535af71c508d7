"""SIGKILL (no clean-up at all: the OOM killer, a lost node) at chosen points of a real
``relayrl train`` / ``relayrl sft`` process, then ``--resume``: the newest complete checkpoint
is intact and the one resumed from, a half-written one is never taken for it, nothing saved is
lost, ``metrics.jsonl`` holds each step once, and a sync run ends bit-identical to the
uninterrupted run (docs/first-run.md, "Exactness")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crash_points import kill_at
from relayrl.cli import main
from relayrl.controller.checkpoint import checkpoint_problem, latest_checkpoint
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from tiny_runs import train_argv, write_config

HERE = Path(__file__).resolve().parents[1] / "support"
VARIED = ("reward.fn=tiny_runs:varied_reward", "train.save_every=1")  # every update moves weights
KEYS = ("actor/loss", "actor/grad_norm", "reward_mean")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "reward_mean" in r]


def _rows(run: Path) -> dict[int, list[float]]:
    return {r["step"]: [r[k] for k in KEYS] for r in read_metrics(run) if "reward_mean" in r}


def _same_weights(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):
    """The uninterrupted 4-step sync run the killed ones must reproduce."""
    tmp = tmp_path_factory.mktemp("straight")
    run = tmp / "run"
    assert main(train_argv(write_config(tmp / "s.yaml", tiny, run), "train.steps=4", *VARIED)) == 0
    return run


CASES = {
    # (point, nth, keep, step): where the kill lands, train.keep_checkpoints, and the step of
    # the checkpoint the resume must start from
    "during_a_checkpoint_write": ("ckpt_write", 3, 1, 2),
    "mid_step": ("update", 3, 2, 2),
    "after_the_rename_before_latest": ("ckpt_commit", 3, 2, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_sigkilled_sync_run_resumes_bit_identically(tiny, straight, tmp_path, case, capsys):
    point, nth, keep, resumed_at = CASES[case]
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    argv = train_argv(config, "train.steps=4", *VARIED, f"train.keep_checkpoints={keep}")
    kill_at(point, nth, argv, tmp_path)
    ckpts = run / "checkpoints"
    newest = latest_checkpoint(run)
    assert newest is not None and newest.name == f"step_{resumed_at:06d}"
    assert checkpoint_problem(newest) is None  # complete and loadable
    if point == "ckpt_write":  # the half-written step 3 stays a temporary folder
        assert [p.name.split("_")[1] for p in ckpts.glob(".tmp_step_*")] == ["step"]
        assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002"]  # keep=1
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert f"resumed from {newest} at step {resumed_at}" in capsys.readouterr().out
    assert _steps(run) == [1, 2, 3, 4]  # each step once: the killed run's extra step dropped
    assert _rows(run) == _rows(straight)
    _same_weights(ckpts / "step_000004/actor", straight / "checkpoints/step_000004/actor")
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    assert latest_checkpoint(run).name == "step_000004"


def _sft_argv(tmp: Path, model: Path, out: Path, *overrides: str) -> list[str]:
    config = tmp / "sft.yaml"
    config.write_text(
        f"model_path: {model}\noutput_dir: {out}\nbatch_size: 2\nnum_examples: 20\nthreads: 1\n"
        "progress: false\nwarmup_steps: 0\n"
    )
    return ["sft", str(config), *overrides]


def test_sft_resumed_with_more_steps_goes_on_from_the_final_step(tiny, tmp_path, capsys):
    """``steps=3 save_every=2`` checkpoints step 3 too (it used to stop at step 2, so a resume
    with ``steps=5`` redid step 3); the resumed run ends as a 5-step run does."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(_sft_argv(tmp_path, tiny, whole, "steps=5", "save_every=2")) == 0
    assert main(_sft_argv(tmp_path, tiny, part, "steps=3", "save_every=2")) == 0
    assert sorted(p.name for p in (part / "checkpoints").glob("step_*")) == [
        "step_000002",
        "step_000003",
    ]
    capsys.readouterr()
    assert main(_sft_argv(tmp_path, tiny, part, "steps=5", "save_every=2", "--resume")) == 0
    assert f"resumed from {part}/checkpoints/step_000003 at step 3" in capsys.readouterr().out
    _same_weights(part, whole)


@pytest.mark.parametrize(
    "point,nth",
    [("sft_forward", 3), ("sft_old", 1), ("sft_carry", 1)],
)
def test_a_sigkilled_sft_run_resumes_bit_identically(tiny, tmp_path, capsys, point, nth):
    """Killed in its third step, or in the final save while the new output directory replaces
    the old one (``checkpoints/`` used to be left in a hidden ``.tmp_part_<pid>`` beside it,
    and ``--resume`` found none): ``--resume`` finds the checkpoints and ends as the
    uninterrupted run."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    argv = ["steps=4", "save_every=1"]
    assert main(_sft_argv(tmp_path, tiny, whole, *argv)) == 0
    kill_at(point, nth, _sft_argv(tmp_path, tiny, part, *argv, "steps=4"), tmp_path)
    capsys.readouterr()
    rc = main(_sft_argv(tmp_path, tiny, part, *argv, "steps=5", "--resume"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    done = 2 if point == "sft_forward" else 4
    assert f"resumed from {part}/checkpoints/step_{done:06d} at step {done}" in out
    assert main(_sft_argv(tmp_path, tiny, whole, *argv, "steps=5", "--resume")) == 0
    _same_weights(part, whole)
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == [".part.lock", ".whole.lock"]  # the output dirs' locks, nothing left over


@pytest.mark.slow
def test_a_sigkilled_async_run_resumes_without_training_an_admission_id_twice(tiny, tmp_path):
    """``schedule=async``, killed in its third update: the resumed run trains on from the
    checkpoint's buffer state; across the checkpointed steps of the killed run and the resumed
    run no admission id is trained twice, and each step is logged once."""
    run = tmp_path / "run"
    takes = tmp_path / "takes.jsonl"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    argv = train_argv(config, "train.steps=4", *VARIED, "schedule=async")
    env = {"RELAYRL_RECORD_TAKES": str(takes)}
    kill_at("update", 3, argv, tmp_path, env)
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and checkpoint_problem(ckpt) is None
    done = int(ckpt.name.split("_")[1])
    first = [json.loads(line) for line in takes.read_text().splitlines()]
    killed_pid = first[0]["pid"]
    committed = [r["ids"] for r in first if r["pid"] == killed_pid][:done]
    proc = subprocess.run(
        [sys.executable, str(HERE / "crash_points.py"), "update", "0", str(tmp_path / "never")]
        + ["--", *argv, "--resume"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {ckpt} at step {done}" in proc.stdout
    rows = [json.loads(line) for line in takes.read_text().splitlines()]
    resumed = [r["ids"] for r in rows if r["pid"] != killed_pid]
    assert len(committed) == done and len(resumed) == 4 - done
    ids = [i for step in committed + resumed for i in step]
    assert len(ids) == len(set(ids)), committed + resumed
    assert _steps(run) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_background_evaluation_pending_at_the_checkpoint_is_run_again_on_resume(tiny, tmp_path):
    """``schedule=async``: the evaluation of step 2 runs beside training and is logged with a
    later step's record; killed in step 3's update, after step 2's checkpoint, that record was
    never written (or is dropped by the resume), and the resumed run from step 2 did not
    evaluate step 2 again: its record was lost. Now the resume evaluates it again."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    over = ("reward.fn=tiny_runs:varied_reward", "train.save_every=2", "train.eval_every=2")
    argv = train_argv(config, "train.steps=4", *over, "schedule=async")
    kill_at("update", 3, argv, tmp_path)
    assert latest_checkpoint(run).name == "step_000002"
    assert not any("eval/at_step" in r for r in read_metrics(run))
    proc = subprocess.run(  # point 0: never parks (a subprocess: tiny_runs on its path)
        [sys.executable, str(HERE / "crash_points.py"), "update", "0", str(tmp_path / "never")]
        + ["--", *argv, "--resume"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "evaluating step 2 again: its record was lost with the stopped run" in proc.stdout
    again = [r for r in read_metrics(run) if "eval/at_step" in r]
    assert [(r["eval/at_step"], r["eval/version_min"], r["eval/version_max"]) for r in again] == [
        (2.0, 2.0, 2.0)  # once, on step 2's weights
    ]
    assert _steps(run) == [1, 2, 3, 4]


def test_a_full_disk_in_sfts_final_save_is_one_line_and_resume_writes_the_model(
    tiny, tmp_path, capsys, monkeypatch
):
    """safetensors reports ENOSPC as a RuntimeError (it used to escape as a traceback); the
    final step's checkpoint is intact, and ``--resume`` with the same ``steps`` only writes the
    missing model (it used to refuse: no step left to train)."""
    from relayrl.controller import sft

    whole, part = tmp_path / "whole", tmp_path / "part"
    argv = ["steps=3", "save_every=2"]
    assert main(_sft_argv(tmp_path, tiny, whole, *argv)) == 0
    real = sft.save_model_atomic

    def full_disk(model, tokenizer, out, *a, **k):
        raise RuntimeError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(sft, "save_model_atomic", full_disk)
    capsys.readouterr()
    assert main(_sft_argv(tmp_path, tiny, part, *argv)) == 1
    assert capsys.readouterr().err.strip() == (
        f"relayrl sft: error: the model could not be written to {part} (No space left on "
        f"device); the newest intact checkpoint is {part}/checkpoints/step_000003; write it "
        "with --resume"
    )
    assert not (part / "config.json").exists()
    monkeypatch.setattr(sft, "save_model_atomic", real)
    assert main(_sft_argv(tmp_path, tiny, part, *argv, "--resume")) == 0
    assert f"saved {part}" in capsys.readouterr().out
    _same_weights(part, whole)
    rc = main(_sft_argv(tmp_path, tiny, part, *argv, "--resume"))  # the model is there now
    assert rc == 2 and "asks for no more" in capsys.readouterr().err


def test_a_run_killed_in_its_final_evaluation_is_finished_by_resume(
    tiny, straight, tmp_path, capsys
):
    """Killed after the last step's checkpoint, in the final evaluation: ``--resume`` with the
    same ``train.steps`` evaluates and ends the run as the uninterrupted one did (it used to be
    refused: no step left to train, and the run never got its final evaluation); once ended,
    it is refused again."""
    run = tmp_path / "run"
    argv = train_argv(write_config(tmp_path / "run.yaml", tiny, run), "train.steps=4", *VARIED)
    kill_at("eval", 2, argv, tmp_path)  # the first is step 0's
    assert latest_checkpoint(run).name == "step_000004"
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    evals = lambda r: [(x["step"], x["eval/pass_rate"]) for x in read_metrics(r) if "eval/n" in x]  # noqa: E731
    assert evals(run) == evals(straight) and [s for s, _ in evals(run)] == [0, 4]
    assert _rows(run) == _rows(straight)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    assert "asks for no more" in capsys.readouterr().err


def test_torn_last_lines_of_the_run_logs_are_cut_before_the_resume_appends(tiny, tmp_path, capsys):
    """A power loss mid-append leaves half a line at the end of ``trajectories.jsonl`` and of
    ``metrics.jsonl``; ``--resume`` cuts both off before it appends, so each reads back whole
    (no warning, no error) with the resumed step after the earlier ones."""
    import warnings

    from relayrl.env.export import read_trajectories

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    argv = train_argv(config, *VARIED, "train.save_trajectories=true")
    assert main([*argv, "train.steps=2"]) == 0
    with (run / "trajectories.jsonl").open("a") as f:
        f.write('{"step": 2, "index": 0, "torn_ma')
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward_me')
    capsys.readouterr()
    assert main([*argv, "train.steps=3", "--resume"]) == 0
    out = capsys.readouterr().out  # the resume says what it cut, one line per log
    for name in ("trajectories.jsonl", "metrics.jsonl"):
        assert f"off {run / name}" in out and "cut the torn line" in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_trajectories(run)
        assert _steps(run) == [1, 2, 3]
    steps = [r["step"] for r in records]  # the trainer's 0-based step of each trajectory
    assert steps == sorted(steps) and set(steps) == {0, 1, 2}
    assert "torn_ma" not in (run / "trajectories.jsonl").read_text()


def test_a_resume_moves_the_trajectories_of_the_steps_it_trains_again_aside(tiny, tmp_path):
    """SIGKILLed in step 2's update, after its trajectories were appended, with the checkpoint
    of step 1 on disk: ``--resume`` trains step 2 again, and ``trajectories.jsonl`` holds each
    step's trajectories once (it used to hold step 2's twice, as ``metrics.jsonl`` never did).
    The killed run's rows of step 2 are kept in ``trajectories.rewound-1.jsonl``; the sync
    resume trains the same rollouts again, so they equal the new ones."""
    from relayrl.env.export import read_trajectories

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    argv = train_argv(config, *VARIED, "train.save_trajectories=true", "train.steps=3")
    kill_at("update", 2, argv, tmp_path)
    assert latest_checkpoint(run).name == "step_000001"
    before = read_trajectories(run)
    assert {r["step"] for r in before} == {0, 1}  # the trainer's 0-based step: 1 is step 2
    assert main([*argv, "--resume"]) == 0
    assert _steps(run) == [1, 2, 3]
    records = read_trajectories(run)
    keys = [(r["step"], r["index"]) for r in records]
    assert len(keys) == len(set(keys)) and keys == sorted(keys)
    assert {s for s, _ in keys} == {0, 1, 2}
    aside = [
        json.loads(x) for x in (run / "trajectories.rewound-1.jsonl").read_text().split("\n") if x
    ]
    assert aside and aside == [r for r in before if r["step"] == 1]
    assert aside == [r for r in records if r["step"] == 1]

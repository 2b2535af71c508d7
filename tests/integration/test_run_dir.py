"""A run directory belongs to one run: a second start is refused with every file untouched,
``--overwrite`` moves the old run aside intact, two processes never share a directory, a
resume with nothing left to train is refused, and leftovers of interrupted writes go."""

from __future__ import annotations

import errno
import io
import os
import re
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.controller.faults import RunDirError
from relayrl.controller.run_dir import claim_output_dir, claim_run_dir
from relayrl.model import build_tiny_model, save_model_atomic
from relayrl.telemetry import MetricsLogger
from tiny_runs import cli, file_hashes, train_argv, write_config


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


def test_second_start_is_refused_and_overwrite_moves_the_old_run_aside(finished, capsys):
    run, config = finished
    before = file_hashes(run)
    assert {"config.yaml", "metrics.jsonl", "checkpoints/step_000002/trainer_state.pt"} <= set(
        before
    )
    rc, err = _run(capsys, train_argv(config, "train.steps=3"))
    assert rc == 2
    assert err == (
        f"relayrl train: error: run directory {run} already holds a run (checkpoints up to "
        "step_000002, config.yaml, metrics.jsonl, timeline.json); continue it with --resume, "
        f"start elsewhere with run_dir=..., or pass --overwrite to move it to {run}.prev-1"
    )
    assert file_hashes(run) == before  # every file byte-identical, the lock file included

    rc = main(train_argv(config, "train.steps=1", flags=("--overwrite",)))
    out = capsys.readouterr().out
    assert rc == 0
    assert f"the earlier run in {run} was moved to {run}.prev-1" in out
    aside = file_hashes(run.parent / "run.prev-1")
    assert aside == {k: v for k, v in before.items() if k != ".lock"}  # moved, intact
    now = file_hashes(run)
    assert "checkpoints/step_000001/trainer_state.pt" in now
    assert not any(k.startswith("checkpoints/step_000002") for k in now)


def test_two_runs_started_at_once_on_one_directory_one_refuses(tiny, tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    procs = [cli(*train_argv(config, "train.steps=2")) for _ in range(2)]
    results = sorted((p.wait(timeout=300), p.stderr.read().strip()) for p in procs)
    (rc_ok, err_ok), (rc_refused, err_refused) = results
    assert rc_ok == 0, err_ok
    assert rc_refused == 2 and len(err_refused.splitlines()) == 1
    # the second either met the first's lock, or (started late) its finished run
    locked = re.fullmatch(
        rf"relayrl train: error: run directory {run} is in use by another relayrl run "
        r"\(pid \d+\); wait for it to end, or choose another run_dir=\.\.\.",
        err_refused,
    )
    assert locked or err_refused.startswith(f"relayrl train: error: run directory {run} already")
    assert [r["step"] for r in _records(run) if "reward_mean" in r] == [1, 2]


def _records(run):
    from relayrl.telemetry import read_metrics

    return read_metrics(run)


def test_a_second_claim_on_a_held_directory_names_the_holder(tmp_path):
    with claim_run_dir(tmp_path / "run"):
        for resume in (False, True):
            with pytest.raises(RunDirError) as e:
                claim_run_dir(tmp_path / "run", resume=resume)
            assert str(e.value) == (
                f"run directory {tmp_path / 'run'} is in use by another relayrl run "
                f"(pid {os.getpid()}); wait for it to end, or choose another run_dir=..."
            )
    claim_run_dir(tmp_path / "run").release()  # free again once released


def test_resume_with_nothing_left_to_train_is_refused(finished, capsys):
    run, config = finished
    before = file_hashes(run)
    for steps in (2, 1):
        rc, err = _run(capsys, train_argv(config, f"train.steps={steps}", flags=("--resume",)))
        assert rc == 2
        assert err == (
            f"relayrl train: error: --resume: the newest checkpoint {run}/checkpoints/"
            f"step_000002 is at step 2 and train.steps={steps} asks for no more; set "
            "train.steps above 2 to train further"
        )
        assert file_hashes(run) == before  # config.yaml and metrics.jsonl untouched


def test_resume_keeps_the_earlier_config_and_logs_each_step_once(finished, capsys):
    run, config = finished
    first_config = (run / "config.yaml").read_bytes()
    assert main(train_argv(config, "train.steps=3", flags=("--resume",))) == 0
    assert (run / "config.prev-1.yaml").read_bytes() == first_config
    assert "steps: 3" in (run / "config.yaml").read_text()
    steps = [(r["step"], "eval/pass_rate" in r) for r in _records(run)]
    assert steps == [(0, True), (1, False), (2, False), (2, True), (3, False), (3, True)]


def test_resume_without_a_checkpoint_moves_the_files_aside(tiny, tmp_path, capsys):
    """A job that died before its first checkpoint and is restarted with --resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/pass_rate": 0.5}\n')
    config = write_config(tmp_path / "run.yaml", tiny, run)
    assert main(train_argv(config, "train.steps=1", flags=("--resume",))) == 0
    out = capsys.readouterr().out
    assert (
        f"no checkpoint to resume from: starting at step 0; the earlier run in {run} was moved "
        f"to {run}.prev-1" in out
    )
    assert (tmp_path / "run.prev-1" / "metrics.jsonl").read_text() == (
        '{"step": 0, "eval/pass_rate": 0.5}\n'
    )
    assert [r["step"] for r in _records(run)] == [0, 1, 1]


def test_leftovers_of_interrupted_writes_are_removed_at_start(finished, capsys):
    run, config = finished
    stale = run / "checkpoints" / ".tmp_step_000003_999999"
    (stale / "actor").mkdir(parents=True)
    (stale / "actor" / "model.safetensors").write_bytes(b"\0" * 1024)
    (run / "checkpoints" / ".latest_999999").write_text("step_000003\n")
    assert main(train_argv(config, "train.steps=3", flags=("--resume",))) == 0
    out = capsys.readouterr().out
    assert (
        f"removed what interrupted writes left in {run}: .latest_999999, .tmp_step_000003_999999"
        in out
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "step_000002",
        "step_000003",
    ]


def test_a_read_only_run_directory_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Every way into the directory fails as on a read-only mount (EROFS)."""
    run = tmp_path / "ro" / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)

    def read_only(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(tmp_path / "ro")):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)

        return call

    for owner, name in ((os, "open"), (os, "mkdir"), (io, "open")):
        monkeypatch.setattr(owner, name, read_only(getattr(owner, name)))
    monkeypatch.setattr("builtins.open", read_only(open))
    rc, err = _run(capsys, train_argv(config, "train.steps=1"))
    assert rc == 2
    assert (
        err
        == f"relayrl train: error: run directory {run} cannot be written (Read-only file system)"
    )


def test_dpo_in_a_directory_that_holds_a_run_is_refused(tiny, tmp_path):
    from helpers import run_config
    from relayrl.controller.trainer import train

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 7\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "dpo_eval/accuracy": 0.5}\n')
    before = file_hashes(run)
    cfg = run_config(tiny, run, "algo.name=dpo", "algo.kl_coef=0.1")
    with pytest.raises(RunDirError, match=r"already holds a run \(config\.yaml, metrics\.jsonl\)"):
        train(cfg, lambda a, c: pytest.fail("DPO builds no roles"))
    assert file_hashes(run) == {**before, ".lock": file_hashes(run)[".lock"]}


def test_the_config_of_a_start_that_logged_nothing_is_kept_not_refused(tiny, tmp_path, capsys):
    """A start that failed before its first record (e.g. a wrong data path) left config.yaml
    only: the next start goes ahead, and keeps that config as config.prev-1.yaml."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 7\n")
    config = write_config(tmp_path / "run.yaml", tiny, run)
    assert main(train_argv(config, "train.steps=1")) == 0
    assert (run / "config.prev-1.yaml").read_text() == "seed: 7\n"
    assert [r["step"] for r in _records(run)] == [0, 1, 1]


def test_metrics_rewrite_on_resume_only_when_needed_and_atomic(tmp_path, monkeypatch):
    """Nothing to drop: the file is not replaced (same inode). Something to drop: it is replaced
    in one step, and a failed replacement leaves it whole with no temporary file."""
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(4):
            log.log(step, {"x": float(step)})
    path = tmp_path / "metrics.jsonl"
    inode, text = path.stat().st_ino, path.read_text()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=3).close()
    assert (path.stat().st_ino, path.read_text()) == (inode, text)

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full_disk)  # relayrl.durable.replace_durable's rename
    with pytest.raises(OSError, match="No space left on device"):
        MetricsLogger(tmp_path, tensorboard=False, resume_step=1)
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    monkeypatch.undo()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=1).close()
    assert path.read_text() == "".join(text.splitlines(keepends=True)[:2])


def test_a_refused_claim_waits_briefly_for_the_holders_pid(tmp_path):
    """The holder writes its pid just after taking the lock: a process refused in between
    reads again instead of naming "pid unknown" (a two-process start saw exactly that)."""
    import threading

    from relayrl.controller.run_dir import _holder

    lock = tmp_path / ".lock"
    lock.write_text("")
    threading.Timer(0.05, lambda: lock.write_text("4321\n")).start()
    assert _holder(lock) == "4321"
    lock.write_text("")
    assert _holder(lock, wait_s=0.05) == "unknown"


def test_a_second_sft_claim_on_a_held_output_directory_is_refused(tmp_path):
    """``relayrl sft``'s ``output_dir`` is locked as a run directory is (it was not: two runs
    wrote one output directory at once), with ``.<name>.lock`` beside it: the final save swaps
    the directory, so a lock file in it would move away with the old one."""
    out = tmp_path / "sft"
    out.mkdir()  # as a first run's checkpoints make it
    with claim_output_dir(out):
        for resume in (False, True):
            with pytest.raises(RunDirError) as e:
                claim_output_dir(out, resume=resume)
            assert str(e.value) == (
                f"output directory {out} is in use by another relayrl run (pid {os.getpid()}); "
                "wait for it to end, or choose another output_dir=..."
            )
        save_model_atomic(_Saver(), _Saver(), out)  # the final save swaps the directory
        with pytest.raises(RunDirError, match="is in use by another relayrl run"):
            claim_output_dir(out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sft.lock", "sft"]
    with claim_output_dir(out, overwrite=True) as run:  # released: a later run goes ahead
        assert run.moved_to == tmp_path / "sft.prev-1"


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "config.json").write_text("{}")


def test_run_sft_called_directly_locks_its_output_directory(tiny, tmp_path):
    """``run_sft`` takes ``output_dir``'s lock itself, so the labs' and the demo's SFT runs
    (which call it directly, not through ``relayrl sft``) are refused while another run holds
    it (they took none); ``relayrl sft`` holds it from its claim and is not refused by it."""
    from relayrl.config import SFTConfig
    from relayrl.controller.sft import run_sft

    out = tmp_path / "sft"
    cfg = SFTConfig(
        model_path=str(tiny), output_dir=str(out), steps=1, batch_size=2, num_examples=4
    )
    cfg = cfg.model_copy(update={"threads": 1, "progress": False, "warmup_steps": 0})
    with claim_output_dir(out):  # held as a running `relayrl sft` holds it
        with pytest.raises(RunDirError, match=f"output directory {out} is in use by another"):
            run_sft(cfg)
    assert not out.exists()
    run_sft(cfg)  # released: goes ahead, and releases it at the end
    assert (out / "config.json").is_file()
    with claim_output_dir(out, overwrite=True):
        pass


def test_run_sft_called_directly_completes_a_final_save_a_kill_interrupted(tiny, tmp_path, capsys):
    """What an SFT run SIGKILLed between the two renames of its final save left (no
    ``output_dir``; the new model in ``.tmp_sft_<pid>``, the old directory with its
    ``checkpoints/`` in ``.old_sft_<pid>``) is completed by the next ``run_sft`` called
    directly (the labs, ``relayrl demo``), as ``relayrl sft``'s claim completes it: nothing is
    left hidden beside the output, the checkpoints are back in it."""
    import subprocess
    import sys

    from relayrl.config import SFTConfig
    from relayrl.controller.sft import run_sft

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "sft"
    old = tmp_path / f".old_sft_{dead.pid}"
    (old / "checkpoints/step_000004").mkdir(parents=True)
    (old / "checkpoints/step_000004/trainer_state.pt").write_bytes(b"")
    (old / "config.json").write_text("{}")
    new = tmp_path / f".tmp_sft_{dead.pid}"
    new.mkdir()
    (new / "config.json").write_text("{}")
    cfg = SFTConfig(
        model_path=str(tiny), output_dir=str(out), steps=1, batch_size=2, num_examples=4
    )
    run_sft(cfg.model_copy(update={"threads": 1, "progress": False, "warmup_steps": 0}))
    said = capsys.readouterr().out
    assert f"completed the interrupted save of {out}" in said
    assert f"recovered {out}/checkpoints from an interrupted save" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sft.lock", "sft"]
    assert (out / "checkpoints/step_000004/trainer_state.pt").is_file()
    assert (out / "model.safetensors").is_file()  # the new run's model saved over it

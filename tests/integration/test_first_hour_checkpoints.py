"""The first hour (issue 44), checkpoints and resume: each defect a user met on their own model,
as the one line and exit code ``relayrl train`` ends with. ``--resume`` refuses a run it cannot
continue (a missing or empty run directory, another model or algorithm), a full disk or any
other OSError during a checkpoint names the cause and the intact checkpoint, a corrupt
checkpoint falls back to the newest intact one (none intact, or corrupt model weights: one
line), and a resumed run's progress count and its not-exact note."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from relayrl.cli import main
from relayrl.model import build_tiny_model
from tiny_runs import file_hashes, mounted_tmpfs, run_cli, train_argv, write_config


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


# ---- --resume refuses what it cannot continue ---------------------------------------------
def test_resume_of_a_missing_or_empty_run_directory_is_refused(tiny, tmp_path, capsys):
    for run, why in ((tmp_path / "typo", "does not exist"), (tmp_path / "empty", "holds no run")):
        if why == "holds no run":
            run.mkdir()
        config = write_config(tmp_path / "run.yaml", tiny, run)
        rc, err = run_cli(capsys, train_argv(config, "train.steps=2", flags=("--resume",)))
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
    rc, err = run_cli(
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
    same = os.path.relpath(tiny)  # the same model, spelled another way: not a change
    assert main(train_argv(config, "train.steps=3", f"model.path={same}", flags=("--resume",))) == 0
    rc = main(
        train_argv(
            config,
            "train.steps=4",
            "algo.name=ppo",
            flags=("--resume", "--allow-config-change"),
        )
    )
    assert rc == 0
    assert "name: ppo" in (run / "config.yaml").read_text()


# ---- a full disk during a checkpoint: one line naming the cause and the intact checkpoint ----
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root and a mountable tmpfs needed; skipped elsewhere)."""
    with mounted_tmpfs(tmp_path / "tmpfs", "2m") as where:
        yield where


def _fill(where: Path, leave: int) -> None:
    """Write a filler file until ``leave`` bytes are free under ``where``."""
    free = shutil.disk_usage(where).free
    with open(where / "filler", "wb") as fh:
        fh.write(b"\0" * max(free - leave, 0))


def test_checkpoint_on_a_full_tmpfs_is_one_line(tiny, small_tmpfs, tmp_path, capsys, monkeypatch):
    """The second checkpoint meets a full disk inside torch's zip writer (whose own error is
    ``unexpected pos N vs M``): the line names the disk and the intact checkpoint."""
    from relayrl.controller import trainer

    run = small_tmpfs / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_save = trainer.save_checkpoint
    calls = {"n": 0}

    def save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the weights fit; trainer_state.pt (120 kB) does not
            _fill(small_tmpfs, 96 * 1024)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer, "save_checkpoint", save)
    rc, err = run_cli(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        "relayrl train: error: checkpoint step_000002 could not be written (No space left on "
        f"device); the newest intact checkpoint is {run}/checkpoints/step_000001"
    )
    AutoModelForCausalLM.from_pretrained(run / "checkpoints/step_000001/actor")


def test_a_full_disk_reported_by_torch_without_an_errno_is_one_line(
    tiny, tmp_path, capsys, monkeypatch
):
    """Fault-injected: torch's zip writer raises a RuntimeError (chained to another) on a short
    write, with no errno; the free space tells that the disk is full."""
    from relayrl.controller import checkpoint as ck

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_save = ck.torch.save
    calls = {"n": 0}

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            try:
                raise RuntimeError("basic_ios::clear: iostream error")
            except RuntimeError:
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:672] . unexpected pos 460032 vs 459920"
                ) from None
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 0)
    rc, err = run_cli(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        "relayrl train: error: checkpoint step_000002 could not be written (No space left on "
        f"device); the newest intact checkpoint is {run}/checkpoints/step_000001"
    )
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1 << 40)
    calls["n"] = 0
    rc, err = run_cli(
        capsys, train_argv(config, "train.steps=3", "train.save_every=1", flags=("--overwrite",))
    )
    assert rc == 1
    assert err.startswith(
        "relayrl train: error: checkpoint step_000002 could not be written (write failed: "
        "[enforce fail at inline_container.cc:672] . unexpected pos 460032 vs 459920); "
    )


# ---- corrupt weights and checkpoints ------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "actor/model.safetensors"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(finished, capsys, damaged):
    run, config = finished
    _truncate(run / "checkpoints/step_000002" / damaged)
    rc = main(train_argv(config, "train.steps=3", flags=("--resume",)))
    out = capsys.readouterr().out
    assert rc == 0
    assert f"checkpoint {run}/checkpoints/step_000002 cannot be read (" in out
    assert (
        f"kept as corrupt_step_000002, resuming from the newest intact checkpoint "
        f"{run}/checkpoints/step_000001" in out
    )
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in out
    assert (run / "checkpoints/corrupt_step_000002" / damaged).is_file()  # kept, not deleted
    assert (run / "checkpoints/step_000003/trainer_state.pt").is_file()


def test_every_checkpoint_corrupt_and_corrupt_model_weights_are_one_line(finished, capsys):
    run, config = finished
    for step in (1, 2):
        _truncate(run / f"checkpoints/step_00000{step}/trainer_state.pt")
    rc, err = run_cli(capsys, train_argv(config, "train.steps=3", flags=("--resume",)))
    assert rc == 2
    assert err.startswith(
        f"relayrl train: error: --resume: no checkpoint in {run} can be read (step_000002: "
        "trainer_state.pt cannot be read: "
    )
    assert "; step_000001: trainer_state.pt cannot be read: " in err
    model = run / "checkpoints/step_000001/actor"
    _truncate(model / "model.safetensors")
    for argv in (
        train_argv(config, f"model.path={model}", f"run_dir={run}-new"),
        ["serve", str(model), "--seconds", "0.1"],
    ):
        rc, err = run_cli(capsys, argv)
        assert rc == 2
        assert err == (
            f"relayrl {argv[0]}: error: {model}/model.safetensors: the weights file is corrupt or "
            "truncated (Error while deserializing header: incomplete metadata, file not fully "
            "covered)"
        )


def test_the_progress_count_of_a_resumed_run_goes_on_from_its_checkpoint(finished, capsys):
    run, config = finished
    assert main(train_argv(config, "train.steps=4", flags=("--resume",))) == 0
    lines = (run / "progress.log").read_text().splitlines()
    assert " step 3/4 (75%) " in lines[-2] and " step 4/4 (100%) " in lines[-1]
    assert not any(" step 1/2 " in line for line in lines[-2:])


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_resuming_an_async_run_says_it_is_not_exact(tiny, tmp_path, capsys, schedule):
    """Sync resumes bit-identically, overlap and async do not: the resume says so in one line."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    common = (f"schedule={schedule}", "train.save_every=1")
    assert main(train_argv(config, "train.steps=1", *common)) == 0
    capsys.readouterr()
    assert main(train_argv(config, "train.steps=2", *common, flags=("--resume",))) == 0
    out = capsys.readouterr().out
    note = (
        f"note: a {schedule} run resumes correctly but not bit-identically: the generations in "
        "flight when it stopped are generated again, under other timing and policy versions "
        "(only schedule: sync resumes exactly)"
    )
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in out
    assert (note in out.splitlines()) == (schedule == "async"), out


def test_any_oserror_under_the_run_directory_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Permission denied (not one of the disk-full errnos) on a file of the run: one line."""
    from relayrl.telemetry.metrics import MetricsLogger

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(run / "tb"))
        return real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    rc, err = run_cli(capsys, train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert err == (
        f"relayrl train: error: could not write {run}/tb (Permission denied); the newest "
        f"intact checkpoint is {run}/checkpoints/step_000001"
    )

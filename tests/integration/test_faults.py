"""Faults end in one line that says what failed and what is intact: a checkpoint write on a full
disk; SIGINT / SIGTERM (the same clean path: a checkpoint of the last completed step, exit
130 / 143, no worker process, traceback or shared memory left), also when the signal lands in
the middle of a weight update."""

from __future__ import annotations

import errno
import os
import re
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.cli import main
from relayrl.controller.checkpoint import latest_checkpoint, load_trainer_state
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from tiny_runs import (
    alive,
    cli,
    descendants,
    shm_entries,
    train_argv,
    wait_for_step,
    write_config,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _trained_steps(run):
    return [r["step"] for r in read_metrics(run) if "reward_mean" in r]


def test_checkpoint_write_on_a_full_disk_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """The second checkpoint fails with ENOSPC, and so does the timeline written while the run
    cleans up: the user is told which checkpoint failed and which one is intact."""
    from relayrl.controller import checkpoint as ck
    from relayrl.telemetry.timeline import Timeline

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_save = ck.torch.save
    calls = {"n": 0}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            (path.parent / "partial.bin").write_bytes(b"\0" * 4096)  # half-written
            full_disk()
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ck.torch, "save", save)
    monkeypatch.setattr(Timeline, "write", full_disk)
    rc = main(train_argv(config, "train.steps=3", "train.save_every=1"))
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert err == (
        "relayrl train: error: checkpoint step_000002 could not be written (No space left on "
        f"device); the newest intact checkpoint is {run}/checkpoints/step_000001"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    AutoModelForCausalLM.from_pretrained(run / "checkpoints/step_000001/actor")


def test_a_full_disk_under_the_metrics_file_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    from relayrl.telemetry.metrics import MetricsLogger

    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    real_log = MetricsLogger.log

    def log(self, step, metrics):
        if step == 2:

            class FullDisk:
                def write(self, text):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self._file = FullDisk()
        return real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    rc = main(train_argv(config, "train.steps=3", "train.save_every=1"))
    assert rc == 1
    assert capsys.readouterr().err.strip() == (
        f"relayrl train: error: could not write {run}/metrics.jsonl (No space left on device); "
        f"the newest intact checkpoint is {run}/checkpoints/step_000001"
    )


def _update_sending(monkeypatch, signals_at_call: int, count: int) -> None:
    """Make the actor's ``signals_at_call``-th update send SIGINT to this process ``count``
    times before it changes any weight (as a Ctrl-C in the middle of the update would)."""
    from relayrl.workers.actor import ActorWorker

    real = ActorWorker.update
    calls = {"n": 0}

    def update(self, exp):
        calls["n"] += 1
        if calls["n"] == signals_at_call:
            for _ in range(count):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)  # the handler runs in between
        return real(self, exp)

    monkeypatch.setattr(ActorWorker, "update", update)


VARIED = ("reward.fn=tiny_runs:varied_reward", "train.save_every=1")  # every update moves weights


def test_a_signal_during_an_update_waits_for_the_step_and_resume_is_exact(
    tiny, tmp_path, capsys, monkeypatch
):
    straight = tmp_path / "straight"
    assert (
        main(
            train_argv(write_config(tmp_path / "s.yaml", tiny, straight), "train.steps=3", *VARIED)
        )
        == 0
    )
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    _update_sending(monkeypatch, signals_at_call=2, count=1)
    capsys.readouterr()
    rc = main(train_argv(config, "train.steps=3", *VARIED))
    err = capsys.readouterr().err.strip()
    assert rc == 130
    assert err == (
        f"relayrl train: stopped by SIGINT after step 2; checkpoint {run}/checkpoints/"
        "step_000002 written; continue with --resume"
    )
    assert _trained_steps(run) == [1, 2]
    monkeypatch.undo()
    assert main(train_argv(config, "train.steps=3", *VARIED, flags=("--resume",))) == 0
    keys = ("actor/loss", "actor/grad_norm", "reward_mean")
    rows = {r["step"]: [r[k] for k in keys] for r in read_metrics(run) if "reward_mean" in r}
    same = {r["step"]: [r[k] for k in keys] for r in read_metrics(straight) if "reward_mean" in r}
    assert rows == same
    a = AutoModelForCausalLM.from_pretrained(run / "checkpoints/step_000003/actor").state_dict()
    b = AutoModelForCausalLM.from_pretrained(straight / "checkpoints/step_000003/actor")
    for k, v in b.state_dict().items():
        assert torch.equal(a[k], v), k
    start = AutoModelForCausalLM.from_pretrained(tiny).state_dict()
    assert not all(torch.equal(start[k], v) for k, v in a.items())  # it did train


def test_a_second_signal_abandons_the_step_and_saves_nothing_of_it(
    tiny, tmp_path, capsys, monkeypatch
):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    _update_sending(monkeypatch, signals_at_call=2, count=2)
    rc = main(train_argv(config, "train.steps=3", *VARIED))
    err = capsys.readouterr().err.strip()
    assert rc == 130
    assert err == (
        "relayrl train: stopped by SIGINT during step 2 (a second signal abandoned it); the "
        f"newest intact checkpoint is {run}/checkpoints/step_000001; continue with --resume"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert _trained_steps(run) == [1]


STOPPED = (
    r"relayrl train: stopped by {sig} after step (\d+); checkpoint {run}/checkpoints/"
    r"step_(\d{{6}}) written; continue with --resume"
)


def _stop_and_check(proc, run, sig, to_group: bool, expect_rc: int) -> set[int]:
    """Send ``sig`` after step 1, then: one stderr line, the exit code, a checkpoint of the last
    logged step that loads, no process of the run left; return the run's child processes."""
    wait_for_step(run, 1, proc)
    children = descendants(proc.pid)
    if to_group:
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C, slurm or systemd do
    else:
        proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().strip()
    assert rc == expect_rc, err
    name = signal.Signals(sig).name
    m = re.fullmatch(STOPPED.format(sig=name, run=re.escape(str(run))), err)
    assert m, err
    step = int(m.group(1))
    assert int(m.group(2)) == step and step >= 1
    assert _trained_steps(run)[-1] == step  # the last completed (logged) step
    ckpt = latest_checkpoint(run)
    assert ckpt.name == f"step_{step:06d}" and load_trainer_state(ckpt)["step"] == step
    AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    assert not list((run / "checkpoints").glob(".tmp*"))
    assert alive(children) == set()
    return children


def test_sigterm_stops_a_sync_run_with_a_checkpoint_and_a_resume_meanwhile_is_refused(
    tiny, tmp_path
):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    proc = cli(*train_argv(config, "train.steps=100000"))
    wait_for_step(run, 1, proc)
    # the lock: a resume may not join the running run (a second start neither: test_run_dir)
    other = cli(*train_argv(config, "train.steps=100000", flags=("--resume",)))
    assert other.wait(timeout=300) == 2
    assert other.stderr.read().strip() == (
        f"relayrl train: error: run directory {run} is in use by another relayrl run "
        f"(pid {proc.pid}); wait for it to end, or choose another run_dir=..."
    )
    _stop_and_check(proc, run, signal.SIGTERM, to_group=False, expect_rc=143)


@pytest.mark.parametrize(
    "sig,rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_to_an_async_run_leaves_no_worker_traceback_or_shared_memory(
    tiny, tmp_path, sig, rc
):
    """The signal goes to the whole process group, engine worker included (Ctrl-C in a
    terminal; slurm and systemd send SIGTERM so): the worker neither dies under the trainer
    nor prints a traceback, and nothing of the run stays in /dev/shm."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    shm_before = shm_entries()
    proc = cli(*train_argv(config, "train.steps=100000", "schedule=async"), start_new_session=True)
    children = _stop_and_check(proc, run, sig, to_group=True, expect_rc=rc)
    assert children, "an async run has an engine worker process"
    ours = {str(p) for p in {proc.pid, *children}}
    left = {e for e in shm_entries() - shm_before if any(p in e for p in ours)}
    assert left == set()


def test_the_engine_worker_exits_quietly_when_its_parent_is_killed(tiny, tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny, run)
    proc = cli(*train_argv(config, "train.steps=100000", "schedule=async"))
    wait_for_step(run, 1, proc)
    children = descendants(proc.pid)
    assert children
    proc.kill()  # kill -9: no clean-up in the trainer
    proc.wait(timeout=30)
    assert alive(children, wait=15) == set()
    assert proc.stderr.read().strip() == ""  # the worker shares it: no EOFError traceback

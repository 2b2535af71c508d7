"""Issue 43: the sync schedule's stall watchdog (``controller.watchdog``). A rollout step with
no progress for ``failures.stall_s`` seconds is an error naming what is stuck, never a silent
hang; a phase that moves (its probe's counters change) is no stall, however long it takes.

Units on :func:`run_watched` with real threads; integration: ``train`` (sync) with an inline
reward function that blocks and no per-call timeout (``reward.fn_timeout_s: null``), and
``relayrl train --rollout-only`` with the same, each stopped by a 2 s watchdog.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

import failure_helpers
from helpers import run_config
from relayrl.cli import main
from relayrl.cluster.local import build_local_roles
from relayrl.controller.rollout_controller import RolloutStalled as AsyncStalled
from relayrl.controller.trainer import train
from relayrl.controller.watchdog import RolloutStalled, run_watched
from relayrl.model import build_tiny_model


def test_a_blocked_phase_is_an_error_naming_it():
    release = threading.Event()

    def work(mark):
        mark("generating 4 requests")
        mark("reward function f scoring 4 samples")
        release.wait(30)
        return "late"

    try:
        with pytest.raises(RolloutStalled) as e:
            run_watched(work, 0.5, probe=lambda: (7, 3, 1), poll_s=0.05)
    finally:
        release.set()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout stalled: no progress for")
    assert "(failures.stall_s=0.5); stuck: reward function f scoring 4 samples (for " in msg
    assert AsyncStalled is RolloutStalled  # one error type for both schedules


def test_a_phase_whose_counters_move_is_no_stall():
    """The work sleeps for 1.5 s past one mark while the probe's counter grows: the watchdog
    (0.3 s) sees progress at each check and waits for the result."""
    tokens = itertools.count()

    def work(mark):
        mark("generating")
        time.sleep(1.5)
        return 42

    assert run_watched(work, 0.3, probe=lambda: next(tokens), poll_s=0.05) == 42


def test_marks_are_progress_and_errors_pass_through():
    def work(mark):
        for i in range(6):
            mark(f"phase {i}")
            time.sleep(0.15)
        raise ValueError("the work's own error")

    with pytest.raises(ValueError, match="the work's own error"):
        run_watched(work, 0.5, probe=lambda: 0, poll_s=0.05)
    # unwatched (stall_s null): the calling thread runs it
    assert run_watched(lambda mark: threading.current_thread().name, None) == "MainThread"


def test_a_probe_that_hangs_tells_nothing():
    """A backend whose report waits behind the stuck call: its probe never answers, and the
    stall is still reported."""
    release = threading.Event()

    def probe():
        release.wait(30)
        return 1

    try:
        with pytest.raises(RolloutStalled, match="stuck: scoring"):
            run_watched(lambda mark: (mark("scoring"), release.wait(30)), 0.3, probe, 0.05)
    finally:
        release.set()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("stall") / "m", hidden_size=32, seed=1)


@pytest.fixture
def blocking_reward():
    failure_helpers.RELEASE = threading.Event()
    yield "failure_helpers:blocks"
    failure_helpers.RELEASE.set()  # the abandoned thread returns
    failure_helpers.RELEASE = None


def test_sync_training_with_a_blocked_reward_fn_stops_naming_it(tiny, tmp_path, blocking_reward):
    cfg = run_config(
        tiny,
        tmp_path / "run",
        "data.eval_size=2",
        "rollout.max_tokens=4",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.steps=2",
        f"reward.fn={blocking_reward}",
        "reward.fn_timeout_s=null",
        "failures.stall_s=2",
    )
    with pytest.raises(Exception) as e:
        train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    msg = str(e.value)
    assert "\n" not in msg and "rollout stalled: no progress for" in msg, msg
    assert "(failures.stall_s=2); stuck: reward function failure_helpers:blocks scoring 4 " in msg
    assert msg.endswith("(step 1); no checkpoint was written"), msg


def test_rollout_only_with_a_blocked_reward_fn_exits_1_in_one_line(
    tiny, tmp_path, capsys, blocking_reward
):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  path: {tiny}\nlogging:\n  progress: false\n")
    rc = main(
        [
            "train",
            str(cfg),
            "--rollout-only",
            f"run_dir={tmp_path / 'run'}",
            f"reward.fn={blocking_reward}",
            "reward.fn_timeout_s=null",
            "failures.stall_s=2",
            "rollout.max_tokens=4",
            "algo.prompts_per_step=2",
            "algo.group_size=2",
            "train.steps=1",
            "threads=1",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "stuck: reward function failure_helpers:blocks scoring 4 samples" in err

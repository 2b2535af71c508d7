"""Progress in logs: when the console is not a terminal (CI, nohup, a cluster job) a live bar
prints nothing until it ends, so ``StepProgress`` writes plain flushed lines instead."""

from __future__ import annotations

import io
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from relayrl.model import build_tiny_model
from relayrl.telemetry import progress as progress_mod
from relayrl.telemetry.progress import StepProgress, progress_interval


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(progress_mod, "_now", c)
    return c


def _plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, force_jupyter=False), buf


def test_plain_lines_first_every_interval_and_last(clock):
    console, buf = _plain_console()
    with StepProgress(6, "grpo (sync)", console=console, interval_s=25) as bar:
        assert bar.plain
        for step in range(1, 7):
            clock.t += 10.0
            bar.update(step, reward=0.5 * step, pass_rate=0.25)
    assert buf.getvalue().splitlines() == [
        "grpo (sync) step 1/6 (16%) elapsed 0:00:10 eta 0:00:50 reward=0.5 pass_rate=0.25",
        "grpo (sync) step 4/6 (66%) elapsed 0:00:40 eta 0:00:20 reward=2 pass_rate=0.25",
        "grpo (sync) step 6/6 (100%) elapsed 0:01:00 eta 0:00:00 reward=3 pass_rate=0.25",
    ]


def test_a_loop_that_stops_early_still_writes_its_last_step(clock):
    console, buf = _plain_console()
    with StepProgress(100, "sft", console=console, interval_s=30) as bar:
        for step in range(1, 4):  # early stop (target pass rate) at step 3
            clock.t += 1.0
            bar.update(step, loss=2.0 / step)
    assert buf.getvalue().splitlines() == [
        "sft step 1/100 (1%) elapsed 0:00:01 eta 0:01:39 loss=2",
        "sft step 3/100 (3%) elapsed 0:00:03 eta 0:01:37 loss=0.667",
    ]


def test_log_file_gets_the_lines_even_when_the_console_is_quiet(clock, tmp_path):
    log = tmp_path / "run" / "progress.log"
    with StepProgress(2, "ppo (async)", enabled=False, interval_s=0, log_file=log) as bar:
        for step in (1, 2):
            clock.t += 2.0
            bar.update(step, reward=1.0)
    lines = log.read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "
    assert len(lines) == 2
    assert [re.sub(stamp, "", ln, count=1) for ln in lines] == [
        "ppo (async) step 1/2 (50%) elapsed 0:00:02 eta 0:00:02 reward=1",
        "ppo (async) step 2/2 (100%) elapsed 0:00:04 eta 0:00:00 reward=1",
    ]
    assert all(re.match(stamp, ln) for ln in lines)


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("RELAYRL_PROGRESS_INTERVAL_S", "5")
    assert progress_interval() == 5.0
    monkeypatch.setenv("RELAYRL_PROGRESS_INTERVAL_S", "soon")
    with pytest.raises(ValueError) as e:
        progress_interval()
    assert str(e.value) == "RELAYRL_PROGRESS_INTERVAL_S='soon': must be a number of seconds >= 0"
    monkeypatch.delenv("RELAYRL_PROGRESS_INTERVAL_S")
    assert progress_interval() == 30.0


def test_sft_with_redirected_output_prints_progress_while_it_runs(tmp_path):
    """Was: nothing at all until the SFT stage ended."""
    model = build_tiny_model(tmp_path / "base", hidden_size=16)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        f"model_path: {model}\noutput_dir: {tmp_path / 'out'}\nsteps: 1000000\n"
        "batch_size: 4\nnum_examples: 64\nthreads: 1\nwarmup_steps: 0\n"
    )
    env = {**os.environ, "RELAYRL_PROGRESS_INTERVAL_S": "30"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "sft", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for text in proc.stdout or ():
            lines.put(text)

    threading.Thread(target=read, daemon=True).start()
    try:
        line = ""
        deadline = time.monotonic() + 60
        while not line.startswith("sft step ") and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
        assert re.fullmatch(
            r"sft step 1/1000000 \(0%\) elapsed \d:\d\d:\d\d eta \d+:\d\d:\d\d loss=\S+\n", line
        ), line
        assert proc.poll() is None  # printed while the run goes on, not at its end
    finally:
        proc.kill()
        proc.wait()

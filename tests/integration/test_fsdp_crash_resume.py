"""SIGKILL of ``relayrl train`` with an FSDP2 actor on 2 Ray ranks while a sharded checkpoint
is being written: rank 0 has written its part (its DCP shards and ``rank_0.pt``), rank 1 not
yet its ``rank_1.pt`` (parked there by ``tests/support/rank_park``). The partial checkpoint
is never taken for the newest: it is still the temporary ``.tmp_step_*`` folder, removed at
the next start; ``--resume`` loads the checkpoint before it, and the run ends bit-identical to
the uninterrupted one (the promise of ``test_fsdp_train.py``'s sharded resume). Slow: three
Ray runs (about 3 minutes on 2 cores); the default run's FSDP2 checkpoint fault test is
``test_fsdp_checkpoint_faults.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.controller.checkpoint import latest_checkpoint
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics
from tiny_runs import train_argv, write_config

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SRC = Path(__file__).resolve().parents[2] / "src"
FSDP = (
    "cluster=ray",
    "model.fsdp.enabled=true",
    "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
    "model.dtype=float64",
    "algo.mini_batches=1",
    "reward.fn=tiny_runs:varied_reward",
    "train.save_every=1",
    "train.steps=3",
)


def _env(**extra: str) -> dict[str, str]:
    path = [str(SRC), str(SUPPORT), str(SUPPORT / "rank_park")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def _relayrl(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _run(argv: list[str]) -> None:
    proc = _relayrl(argv, _env())
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints/step_000003/actor/model.safetensors")


def test_a_run_killed_mid_sharded_checkpoint_resumes_bit_identically(tmp_path):
    tiny = build_tiny_model(tmp_path / "m", hidden_size=16)
    straight, part = tmp_path / "straight", tmp_path / "part"
    _run(train_argv(write_config(tmp_path / "s.yaml", tiny, straight), *FSDP))
    config = write_config(tmp_path / "p.yaml", tiny, part)
    marker = tmp_path / "parked"
    proc = _relayrl(
        train_argv(config, *FSDP), _env(RELAYRL_PARK_RANK_FILE=str(marker), RELAYRL_PARK_NTH="2")
    )
    deadline = time.monotonic() + 400
    while not marker.exists():  # rank 1 parked in the step-2 checkpoint
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "rank 1 never reached its step-2 rank_1.pt"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    os.kill(int(marker.read_text()), signal.SIGKILL)  # the parked Ray worker, if it outlives
    proc.wait(timeout=60)
    root = part / "checkpoints"
    (partial,) = root.glob(".tmp_step_000002_*")
    assert sorted(p.name for p in (partial / "sharded_actor").glob("rank_*.pt")) == ["rank_0.pt"]
    assert latest_checkpoint(part) == root / "step_000001"  # the partial one is never taken
    _run(train_argv(config, *FSDP, flags=("--resume",)))
    assert not list(root.glob(".tmp_step_*"))
    a, b = _weights(straight), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = {r["step"]: r["actor/loss"] for r in read_metrics(part) if "reward_mean" in r}
    want = {r["step"]: r["actor/loss"] for r in read_metrics(straight) if "reward_mean" in r}
    assert rows == want


def test_a_write_error_on_rank_1_is_one_line_and_keeps_the_checkpoint_before(tmp_path):
    """Rank 1's disk full at its step-2 ``rank_1.pt``: ``relayrl train`` ends (neither rank
    waits in a collective) with one line naming the rank, the cause and the step-1 checkpoint,
    which stays intact and resumable."""
    tiny = build_tiny_model(tmp_path / "m", hidden_size=16)
    run = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", tiny, run)
    env = _env(
        RELAYRL_PARK_RANK_FILE=str(tmp_path / "failed"), RELAYRL_PARK_NTH="2", RELAYRL_PARK_FAIL="1"
    )
    proc = _relayrl(train_argv(config, *FSDP), env)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if "Started a local Ray instance" not in line]
    assert lines == [  # no 'Unhandled error' traceback of the other rank's failure after it
        "relayrl train: error: checkpoint step_000002 could not be written (rank 1 could not "
        "write its part of sharded_actor: No space left on device); the newest intact "
        f"checkpoint is {run}/checkpoints/step_000001"
    ]
    assert latest_checkpoint(run) == run / "checkpoints/step_000001"
    assert not list((run / "checkpoints").glob(".tmp_step_*"))
    _run(train_argv(config, *FSDP, "train.steps=2", flags=("--resume",)))

"""``latest_checkpoint`` (controller/checkpoint.py): the checkpoint ``latest`` names, unless a
save was killed between renaming a higher step's checkpoint into place and updating ``latest``
(then that one); never an older run's leftover written before ``latest`` was."""

from __future__ import annotations

import os
from pathlib import Path

from relayrl.controller.checkpoint import STATE_FILE, latest_checkpoint


def _ckpt(root: Path, step: int, mtime_ns: int) -> Path:
    d = root / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / STATE_FILE).write_bytes(b"")
    os.utime(d / STATE_FILE, ns=(mtime_ns, mtime_ns))
    return d


def _latest(root: Path, step: int, mtime_ns: int) -> None:
    marker = root / "checkpoints" / "latest"
    marker.write_text(f"step_{step:06d}\n")
    os.utime(marker, ns=(mtime_ns, mtime_ns))


def test_a_checkpoint_committed_after_latest_is_the_newest(tmp_path):
    s = 10**18
    _ckpt(tmp_path, 1, s)
    _ckpt(tmp_path, 2, s + 10)
    _latest(tmp_path, 2, s + 20)
    assert latest_checkpoint(tmp_path).name == "step_000002"
    _ckpt(tmp_path, 3, s + 30)  # renamed into place; killed before ``latest`` was replaced
    assert latest_checkpoint(tmp_path).name == "step_000003"


def test_an_older_runs_higher_step_written_before_latest_is_passed_over(tmp_path):
    s = 10**18
    _ckpt(tmp_path, 5, s)  # left by the run a resume from step 2 replaced
    _ckpt(tmp_path, 2, s - 10)
    _ckpt(tmp_path, 3, s + 10)
    _latest(tmp_path, 3, s + 20)
    assert latest_checkpoint(tmp_path).name == "step_000003"
    (tmp_path / "checkpoints/latest").unlink()
    assert latest_checkpoint(tmp_path).name == "step_000005"  # no marker: the highest step

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


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def test_a_full_disk_at_the_latest_marker_says_the_checkpoint_is_written(tmp_path, monkeypatch):
    """The checkpoint is renamed into place, then ``latest`` cannot be written: the line says
    the checkpoint is there (it is the newest intact one) rather than that it failed."""
    import errno
    import pathlib

    import pytest

    from relayrl.controller.checkpoint import save_checkpoint
    from relayrl.controller.faults import CheckpointWriteError

    save_checkpoint(tmp_path, 1, {"actor": _Saver()}, _Saver(), {})
    real = pathlib.Path.write_text

    def write_text(self, *a, **k):
        if self.name.startswith(".latest_"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(tmp_path, 2, {"actor": _Saver()}, _Saver(), {})
    ckpts = tmp_path / "checkpoints"
    assert str(err.value) == (
        f"checkpoint step_000002 is written but {ckpts}/latest could not be updated (No space "
        f"left on device); the newest intact checkpoint is {ckpts}/step_000002"
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000001", "step_000002"]

"""Removing a checkpoint (keep-last-N pruning, or a save over the same step) is durable and
never half-visible (controller/checkpoint.py): the checkpoint is renamed to a hidden
``.pruned_<name>``, ``checkpoints/`` is fsynced, and only then is it deleted. So a pruned
checkpoint cannot reappear after a power loss, and a prune killed mid-deletion leaves nothing
that listing or a resume takes for a checkpoint; the next save or claim removes the leftover.
The run's appended logs are fsynced before a checkpoint's rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fsync_log import Event, at, fsynced, record
from relayrl.controller.checkpoint import (
    RUN_LOGS,
    STATE_FILE,
    intact_checkpoint,
    latest_checkpoint,
    save_checkpoint,
)
from relayrl.controller.run_dir import claim_run_dir


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def _save(run: Path, step: int, keep: int = 2) -> Path:
    """Save checkpoint ``step``; its write time set to ``step`` seconds (pruning goes by write
    time), so the order never depends on the clock's resolution."""
    final = save_checkpoint(run, step, {"actor": _Saver()}, _Saver(), {}, keep=keep)
    os.utime(final / STATE_FILE, ns=(step * 10**9, step * 10**9))
    return final


def _log_rmtree(monkeypatch: pytest.MonkeyPatch, log: list[Event]) -> None:
    real = shutil.rmtree

    def rmtree(path: object, *a: object, **k: object) -> None:
        log.append(("rmtree", str(Path(str(path)).resolve())))
        real(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def _listed(run: Path) -> list[str]:
    """What listing and resume take for checkpoints (``step_*`` with a trainer state)."""
    root = run / "checkpoints"
    return sorted(p.name for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def test_a_pruned_checkpoint_is_renamed_aside_and_the_rename_fsynced_before_deletion(
    tmp_path, monkeypatch
):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    root = (tmp_path / "checkpoints").resolve()
    log = record(monkeypatch)
    _log_rmtree(monkeypatch, log)
    _save(tmp_path, 3)
    aside = root / ".pruned_step_000001"
    renamed = at(log, "rename", root / "step_000001", aside)
    deleted = at(log, "rmtree", aside)
    assert str(root) in fsynced(log[renamed:deleted])
    assert ("rmtree", str(root / "step_000001")) not in log  # never deleted in place
    assert _listed(tmp_path) == ["step_000002", "step_000003"]
    assert not aside.exists()


def test_a_prune_killed_between_rename_and_deletion_leaves_nothing_resume_picks_up(
    tmp_path, monkeypatch
):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    real = shutil.rmtree

    def killed(path: object, *a: object, **k: object) -> None:
        """Killed part-way: the weights gone, the trainer state still there."""
        real(Path(str(path)) / "actor")
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3)
    monkeypatch.setattr(shutil, "rmtree", real)
    root = tmp_path / "checkpoints"
    assert _listed(tmp_path) == ["step_000002", "step_000003"]
    assert (root / ".pruned_step_000001" / STATE_FILE).is_file()  # the half-deleted one
    assert latest_checkpoint(tmp_path) == root / "step_000003"
    assert intact_checkpoint(tmp_path) == (root / "step_000003", [])
    for step in (3, 2):  # the fall-backs of a resume: the newer ones lost
        shutil.rmtree(root / f"step_{step:06d}")
    assert latest_checkpoint(tmp_path) is None
    assert intact_checkpoint(tmp_path) == (None, [])


def test_the_next_claim_or_save_removes_what_a_killed_prune_left(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step)
    root = tmp_path / "checkpoints"
    os.rename(root / "step_000001", root / ".pruned_step_000001")  # killed after the rename
    run = claim_run_dir(tmp_path, resume=True, steps=10)
    try:
        assert run.checkpoint == root / "step_000002"
        assert root / ".pruned_step_000001" in run.removed
    finally:
        run.release()
    shutil.copytree(root / "step_000002", root / ".pruned_step_000000")
    _save(tmp_path, 3, keep=5)  # nothing to prune: the leftover goes all the same
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_a_save_over_the_same_step_sets_the_old_one_aside_before_its_rename(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    old = _save(tmp_path, 2)
    (old / "stale").write_text("from the first save of step 2")
    root = (tmp_path / "checkpoints").resolve()
    log = record(monkeypatch)
    _log_rmtree(monkeypatch, log)
    final = _save(tmp_path, 2)
    aside = root / ".pruned_step_000002"
    tmp = root / f".tmp_step_000002_{os.getpid()}"
    renamed = at(log, "rename", root / "step_000002", aside)
    placed = at(log, "replace", tmp, root / "step_000002")
    deleted = at(log, "rmtree", aside)
    assert renamed < placed < deleted
    assert str(root) in fsynced(log[placed:deleted])  # both renames on disk before deletion
    assert not (final / "stale").exists() and not aside.exists()
    assert _listed(tmp_path) == ["step_000001", "step_000002"]


def test_the_run_logs_are_fsynced_before_the_checkpoint_is_renamed_in(tmp_path, monkeypatch):
    from relayrl.env.export import FILE
    from relayrl.telemetry.metrics import METRICS_FILE

    assert RUN_LOGS == (METRICS_FILE, FILE)
    logs = [tmp_path / name for name in RUN_LOGS]
    for path in logs:
        path.write_text('{"step": 1}\n')
    log = record(monkeypatch)
    final = _save(tmp_path, 1)
    tmp = final.parent / f".tmp_step_000001_{os.getpid()}"
    before = fsynced(log[: at(log, "replace", tmp, final)])
    assert {str(p.resolve()) for p in logs} <= set(before)

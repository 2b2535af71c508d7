"""What the claim of a run directory renames is durable across a power loss
(controller/run_dir.py): ``--overwrite``'s move of the old run into ``<run_dir>.prev-N`` (the
new directory fsynced into its parent before the moves, ``.prev-N`` and the run directory
after them) and a resume's renaming of an unreadable checkpoint to ``corrupt_<name>``
(``checkpoints/`` fsynced after it). A resume's claim cuts a torn last line off the run's
appended logs before anything is appended to them."""

from __future__ import annotations

import os
from pathlib import Path

from fsync_log import at, fsynced, record
from relayrl.controller.checkpoint import STATE_FILE, save_checkpoint
from relayrl.controller.run_dir import claim_run_dir
from relayrl.env.export import read_trajectories
from relayrl.telemetry import read_metrics


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def _save(run: Path, step: int) -> Path:
    final = save_checkpoint(run, step, {"actor": _Saver()}, _Saver(), {}, keep=5)
    os.utime(final / STATE_FILE, ns=(step * 10**9, step * 10**9))
    return final


def test_overwrite_fsyncs_prev_n_into_its_parent_and_both_directories_after_the_moves(
    tmp_path, monkeypatch
):
    run = tmp_path / "run"
    _save(run, 1)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    log = record(monkeypatch)
    claim = claim_run_dir(run, overwrite=True)
    claim.release()
    prev = tmp_path / "run.prev-1"
    assert claim.moved_to == prev.resolve()
    first = at(log, "rename", run / "checkpoints", prev / "checkpoints")
    last = at(log, "rename", run / "metrics.jsonl", prev / "metrics.jsonl")
    assert str(tmp_path.resolve()) in fsynced(log[:first])  # .prev-N itself on disk first
    after = fsynced(log[last:])
    assert str(prev.resolve()) in after and str(run.resolve()) in after
    assert after.index(str(prev.resolve())) < after.index(str(run.resolve()))
    assert sorted(p.name for p in prev.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_a_corrupt_checkpoints_rename_is_fsynced_before_the_resume_goes_on(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    (bad / STATE_FILE).write_bytes(b"not a zip")
    log = record(monkeypatch)
    claim = claim_run_dir(tmp_path, resume=True, steps=10)
    claim.release()
    root = tmp_path / "checkpoints"
    assert claim.checkpoint == root / "step_000001"
    assert [k for _, _, k in claim.corrupt] == [root / "corrupt_step_000002"]
    moved = at(log, "rename", bad, root / "corrupt_step_000002")
    assert str(root.resolve()) in fsynced(log[moved:])


def test_a_resumes_claim_cuts_torn_last_lines_off_the_run_logs(tmp_path, monkeypatch):
    """Killed mid-append: ``trajectories.jsonl`` ends in half a record, ``metrics.jsonl`` in a
    whole record whose newline was lost. The claim cuts the first (19 bytes: the length of
    ``{"step": 2, "index"``) and ends the second, each fsynced, and says so."""
    _save(tmp_path, 1)
    traj, metrics = tmp_path / "trajectories.jsonl", tmp_path / "metrics.jsonl"
    traj.write_text('{"step": 0, "index": 0}\n{"step": 2, "index"')  # 0-based: before step 1
    metrics.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}')
    log = record(monkeypatch)
    claim = claim_run_dir(tmp_path, resume=True, steps=10)
    claim.release()
    assert traj.read_text() == '{"step": 0, "index": 0}\n'
    assert metrics.read_text() == '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n'
    assert {str(traj.resolve()), str(metrics.resolve())} <= set(fsynced(log))
    assert claim.recovered == [
        f"ended the unfinished line 2 of {metrics} with its newline",
        f"cut the torn line 2 (19 bytes) off {traj}",
    ]
    assert read_trajectories(tmp_path) == [{"step": 0, "index": 0}]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]

"""``save_checkpoint`` (controller/checkpoint.py) is durable across a power loss, not only a
kill: every file and directory of the checkpoint is fsynced before it is renamed into place,
``checkpoints/`` after that rename, ``latest`` before its rename and ``checkpoints/`` again
after it, so the checkpoint ``latest`` names is on disk before ``latest`` is."""

from __future__ import annotations

import os
from pathlib import Path

from fsync_log import at, fsynced, record
from relayrl.controller.checkpoint import save_checkpoint


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def test_files_then_directories_then_the_rename_then_latest(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"actor": _Saver()}, _Saver(), {})  # checkpoints/ made
    log = record(monkeypatch)
    final = save_checkpoint(tmp_path, 2, {"actor": _Saver()}, _Saver(), {})
    root = (tmp_path / "checkpoints").resolve()
    tmp = root / f".tmp_step_000002_{os.getpid()}"
    marker_tmp = root / f".latest_{os.getpid()}"
    commit = at(log, "replace", tmp, final)
    marked = at(log, "replace", marker_tmp, root / "latest")
    # every file and directory of the checkpoint, under its temporary name, before the rename
    parts = {tmp / "actor/config.json", tmp / "trainer_state.pt", tmp / "actor", tmp}
    assert {tmp / p.relative_to(final) for p in final.rglob("*")} | {tmp} == parts
    written = {str(p) for p in parts}
    before = fsynced(log[:commit])
    assert written <= set(before)
    files = [before.index(str(tmp / f)) for f in ("actor/config.json", "trainer_state.pt")]
    assert max(files) < before.index(str(tmp / "actor")) < before.index(str(tmp))
    # checkpoints/ after the rename and before latest's; latest's file before its rename
    assert str(root) in fsynced(log[commit:marked])
    assert str(marker_tmp) in fsynced(log[commit:marked])
    assert str(root) in fsynced(log[marked:])
    assert (root / "latest").read_text() == "step_000002\n"


def test_the_first_checkpoint_makes_checkpoints_durable_in_the_run_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    log = record(monkeypatch)
    final = save_checkpoint(run, 1, {"actor": _Saver()}, _Saver(), {})
    made = fsynced(log)
    # run/ and run/checkpoints/ created: each entry fsynced in its parent before the rename
    commit = at(log, "replace", final.parent / f".tmp_step_000001_{os.getpid()}", final)
    assert {str(tmp_path.resolve()), str(run.resolve())} <= set(fsynced(log[:commit]))
    assert made[-1] == str(final.parent.resolve())

"""A run's ``config.yaml`` (``record_config``, controller/run_dir.py) is durable across a power
loss: the new file is fsynced before it is renamed in, and the run directory after the
renames (the earlier config's move to ``config.prev-N.yaml`` too); a run directory the claim
creates is fsynced into its parent."""

from __future__ import annotations

from pydantic import BaseModel

from fsync_log import at, fsynced, record
from relayrl.controller.run_dir import claim_run_dir, record_config


class _Cfg(BaseModel):
    seed: int = 0


def test_config_yaml_is_fsynced_before_its_rename_and_the_run_dir_after(tmp_path, monkeypatch):
    log = record(monkeypatch)
    path = record_config(tmp_path, _Cfg(seed=1))
    tmp = next(e[1] for e in log if e[0] == "replace" and e[2] == str(path.resolve()))
    placed = at(log, "replace", tmp, path)
    assert tmp in fsynced(log[:placed])
    assert str(tmp_path.resolve()) in fsynced(log[placed:])
    assert path.read_text() == "seed: 1\n"


def test_a_changed_config_moves_the_old_one_aside_and_both_renames_are_fsynced(
    tmp_path, monkeypatch
):
    path = record_config(tmp_path, _Cfg(seed=1))
    log = record(monkeypatch)
    record_config(tmp_path, _Cfg(seed=2))
    kept = tmp_path / "config.prev-1.yaml"
    moved = at(log, "rename", path, kept)
    tmp = next(e[1] for e in log if e[0] == "replace" and e[2] == str(path.resolve()))
    placed = at(log, "replace", tmp, path)
    assert tmp in fsynced(log[:moved])  # the new config on disk before the old one moves
    assert moved < placed
    assert str(tmp_path.resolve()) in fsynced(log[placed:])
    assert (kept.read_text(), path.read_text()) == ("seed: 1\n", "seed: 2\n")


def test_an_unchanged_config_is_left_alone(tmp_path, monkeypatch):
    path = record_config(tmp_path, _Cfg(seed=1))
    log = record(monkeypatch)
    record_config(tmp_path, _Cfg(seed=1))
    assert log == [] and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_run_dir_the_claim_creates_is_fsynced_into_its_parent(tmp_path, monkeypatch):
    log = record(monkeypatch)
    run = claim_run_dir(tmp_path / "runs" / "a")
    run.release()
    assert {str(tmp_path.resolve()), str((tmp_path / "runs").resolve())} <= set(fsynced(log))

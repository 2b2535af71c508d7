"""``save_model_atomic`` / ``finish_interrupted_save`` (model/loading.py): a failed write leaves
the output as it was and no temp dir; what a killed save left beside the output (the new
directory, the old one holding the carried ``checkpoints/``) is put back in place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsync_log import at, fsynced, record
from relayrl.model import finish_interrupted_save, save_model_atomic


class _Saver:
    def __init__(self, tag: str, fail: bool = False) -> None:
        self.tag, self.fail = tag, fail

    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(self.tag)
        if self.fail:
            raise OSError(28, "No space left on device")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_failed_write_leaves_the_output_and_no_temp_dir(tmp_path):
    out = tmp_path / "out"
    save_model_atomic(_Saver("old"), _Saver("tok"), out)
    (out / "checkpoints").mkdir()
    with pytest.raises(OSError):
        save_model_atomic(_Saver("new", fail=True), _Saver("tok"), out, keep=("checkpoints",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "config.json").read_text() == "tok" and (out / "checkpoints").is_dir()
    save_model_atomic(_Saver("new"), _Saver("new"), out, keep=("checkpoints",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "checkpoints").is_dir()


def _left(tmp_path: Path, pid: int, out_exists: bool) -> Path:
    """What a save killed after renaming the old output away leaves (``out_exists``: also
    after renaming the new one into place)."""
    old = tmp_path / f".old_out_{pid}"
    (old / "checkpoints/step_000004").mkdir(parents=True)
    (old / "config.json").write_text("old")
    new = tmp_path / ("out" if out_exists else f".tmp_out_{pid}")
    new.mkdir()
    (new / "config.json").write_text("new")
    return tmp_path / "out"


@pytest.mark.parametrize("out_exists", [False, True], ids=["before_the_new_one", "after"])
def test_a_killed_swap_is_finished(tmp_path, out_exists):
    out = _left(tmp_path, _dead_pid(), out_exists)
    done = finish_interrupted_save(out, keep=("checkpoints",))
    assert f"recovered {out}/checkpoints from an interrupted save" in done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "config.json").read_text() == "new"
    assert (out / "checkpoints/step_000004").is_dir()
    assert finish_interrupted_save(out, keep=("checkpoints",)) == []


def test_a_live_writers_files_and_a_dead_ones_partial_write(tmp_path):
    out = _left(tmp_path, os.getpid(), out_exists=False)  # a save under way: not touched
    assert finish_interrupted_save(out, keep=("checkpoints",)) == []
    assert not out.exists()
    partial = tmp_path / f".tmp_other_{_dead_pid()}"
    partial.mkdir()
    finish_interrupted_save(tmp_path / "other")  # killed while writing: removed
    assert not partial.exists()


def test_the_swap_is_durable_files_then_rename_then_directories(tmp_path, monkeypatch):
    """Power loss, not only a kill: the new directory's files, then its subdirectories, then
    itself are fsynced before it is renamed in; the parent after both renames, before
    ``checkpoints/`` moves out of the old one; the new directory after that move."""
    out = tmp_path / "out"
    save_model_atomic(_Saver("old"), _Saver("tok"), out)
    (out / "checkpoints").mkdir()

    def more(tmp: Path) -> None:
        (tmp / "sub").mkdir()
        (tmp / "sub/curves.jsonl").write_text("{}\n")

    log = record(monkeypatch)
    save_model_atomic(_Saver("new"), _Saver("tok"), out, keep=("checkpoints",), fill_more=more)
    tmp = tmp_path / f".tmp_out_{os.getpid()}"
    old = tmp_path / f".old_out_{os.getpid()}"
    swap = at(log, "replace", tmp, out)
    before = fsynced(log[:swap])
    order = [str((tmp / p).resolve()) for p in ("config.json", "sub/curves.jsonl", "sub", ".")]
    assert [before.index(p) for p in order] == sorted(before.index(p) for p in order)
    assert at(log, "replace", out, old) < swap
    carry = at(log, "rename", old / "checkpoints", out / "checkpoints")
    assert str(tmp_path.resolve()) in fsynced(log[swap:carry])
    assert str(out.resolve()) in fsynced(log[carry:])
    assert (out / "checkpoints").is_dir() and (out / "sub/curves.jsonl").is_file()


def test_a_finished_interrupted_swap_is_durable(tmp_path, monkeypatch):
    pid = _dead_pid()
    out = _left(tmp_path, pid, out_exists=False)
    log = record(monkeypatch)
    finish_interrupted_save(out, keep=("checkpoints",))
    put = at(log, "replace", tmp_path / f".tmp_out_{pid}", out)
    carry = at(log, "rename", tmp_path / f".old_out_{pid}/checkpoints", out / "checkpoints")
    assert str(tmp_path.resolve()) in fsynced(log[put:carry])
    assert str(out.resolve()) in fsynced(log[carry:])

"""``write_jsonl`` (data/jsonl.py) replaces its file durably, with ``relayrl.durable``'s
helpers: the temporary file is fsynced before it is renamed over the file, the directory after
the rename, and a directory it creates in its parent."""

from __future__ import annotations

from fsync_log import at, fsynced, record
from relayrl.data.jsonl import write_jsonl


def test_the_file_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"old": 1}\n')
    log = record(monkeypatch)
    assert write_jsonl(path, [{"a": 1}, {"b": 2}]) == 2
    tmp = next(e[1] for e in log if e[0] == "replace" and e[2] == str(path.resolve()))
    placed = at(log, "replace", tmp, path)
    assert tmp in fsynced(log[:placed])
    assert str(tmp_path.resolve()) in fsynced(log[placed:])
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


def test_new_parent_directories_are_fsynced_into_theirs(tmp_path, monkeypatch):
    path = tmp_path / "a" / "b" / "rows.jsonl"
    log = record(monkeypatch)
    write_jsonl(path, [{"a": 1}])
    placed = at(log, "replace", next(e[1] for e in log if e[0] == "replace"), path)
    assert {str(tmp_path.resolve()), str((tmp_path / "a").resolve())} <= set(fsynced(log[:placed]))

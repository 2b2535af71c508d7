"""A resume from the checkpoint of step S trains steps S+1.. again: its claim
(controller/run_dir.py) moves the rows of ``trajectories.jsonl`` of those steps (``step``, the
trainer's 0-based step, at least S) into ``trajectories.rewound-<S>.jsonl``, as
``metrics.jsonl`` drops its records past S, so that each step's trajectories are in the log
once. ``relayrl.durable.split_jsonl_log`` does it streamed and durably: the file set aside
fsynced and renamed in, its directory fsynced, then the cut log likewise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fsync_log import at, fsynced, record
from relayrl.controller.checkpoint import STATE_FILE, save_checkpoint
from relayrl.controller.run_dir import claim_run_dir
from relayrl.durable import split_jsonl_log
from relayrl.env.export import FILE, read_trajectories


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def _save(run: Path, step: int) -> Path:
    final = save_checkpoint(run, step, {"actor": _Saver()}, _Saver(), {}, keep=5)
    os.utime(final / STATE_FILE, ns=(step * 10**9, step * 10**9))
    return final


def _rows(steps: range, per_step: int = 2) -> str:
    return "".join(
        json.dumps({"step": s, "index": i}) + "\n" for s in steps for i in range(per_step)
    )


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_split_keeps_rows_in_order_sets_the_rest_aside_and_drops_a_torn_tail(tmp_path, monkeypatch):
    """Steps 1..5 (two rows each) and a torn sixth line; keep steps <= 3: 1..3 stay in order,
    4..5 go aside; the aside file is fsynced and renamed in (its directory fsynced) before the
    log's temporary file is fsynced and renamed over it (the directory fsynced again)."""
    log_path, aside = tmp_path / "log.jsonl", tmp_path / "log.aside.jsonl"
    log_path.write_text(_rows(range(1, 6)) + '{"step": 6, "ind')
    events = record(monkeypatch)
    with pytest.warns(UserWarning, match=rf"{log_path}: line 11 is torn"):
        kept, moved = split_jsonl_log(log_path, lambda r: r["step"] <= 3, aside)
    assert (kept, moved) == (6, 4)
    assert log_path.read_text() == _rows(range(1, 4))
    assert aside.read_text() == _rows(range(4, 6))
    tmp_keep, tmp_aside = tmp_path / ".log.jsonl.tmp", tmp_path / ".log.aside.jsonl.tmp"
    aside_synced = at(events, "fsync", str(tmp_aside.resolve()))
    aside_in = at(events, "replace", tmp_aside, aside)
    keep_synced = at(events, "fsync", str(tmp_keep.resolve()))
    log_in = at(events, "replace", tmp_keep, log_path)
    assert aside_synced < aside_in < keep_synced < log_in
    directory = str(tmp_path.resolve())
    assert directory in fsynced(events[aside_in:keep_synced])  # the aside file on disk first
    assert directory in fsynced(events[log_in:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.aside.jsonl", "log.jsonl"]


def test_split_leaves_the_log_untouched_when_nothing_goes(tmp_path, monkeypatch):
    """Nothing set aside, no torn line: no rename, no aside file, no temporary file left; a
    last record without its newline only is given one (a rewrite)."""
    log_path, aside = tmp_path / "log.jsonl", tmp_path / "aside.jsonl"
    log_path.write_text(_rows(range(0, 3)))
    events = record(monkeypatch)
    assert split_jsonl_log(log_path, lambda r: r["step"] < 3, aside) == (6, 0)
    assert not [e for e in events if e[0] == "replace"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]
    log_path.write_text('{"step": 0}\n{"step": 1}')
    assert split_jsonl_log(log_path, lambda r: True, aside) == (2, 0)
    assert log_path.read_text() == '{"step": 0}\n{"step": 1}\n' and not aside.exists()


def test_split_refuses_a_bad_line_in_the_middle_and_changes_nothing(tmp_path):
    log_path, aside = tmp_path / "log.jsonl", tmp_path / "aside.jsonl"
    text = '{"step": 0}\n{"step": 1, "ind\n{"step": 2}\n'
    log_path.write_text(text)
    with pytest.raises(ValueError, match=rf"{log_path}: line 2 is not valid JSON"):
        split_jsonl_log(log_path, lambda r: r["step"] < 1, aside)
    assert log_path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_a_resumes_claim_moves_the_trajectories_of_the_steps_it_trains_again(tmp_path):
    """Checkpoint of step 3; the trainer's rows of steps 0..4 (steps 1..5 in ``metrics.jsonl``
    numbering): 0..2 stay, 3..4 (trained again from the checkpoint) move to
    ``trajectories.rewound-3.jsonl``. A second resume from the same checkpoint, after its rows of
    step 3 were appended, keeps the first file and writes ``trajectories.rewound-3.2.jsonl``."""
    _save(tmp_path, 3)
    traj = tmp_path / FILE
    traj.write_text(_rows(range(0, 5)))
    claim = claim_run_dir(tmp_path, resume=True, steps=10)
    claim.release()
    assert _steps(traj) == [0, 0, 1, 1, 2, 2]
    first = tmp_path / "trajectories.rewound-3.jsonl"
    assert _steps(first) == [3, 3, 4, 4]
    assert claim.recovered == [
        f"moved the 4 trajectories of the steps after 3 (trained again) from {traj} to {first}"
    ]
    with traj.open("a") as f:
        f.write(_rows(range(3, 4)))
    claim = claim_run_dir(tmp_path, resume=True, steps=10)
    claim.release()
    assert _steps(traj) == [0, 0, 1, 1, 2, 2]
    assert _steps(first) == [3, 3, 4, 4]
    assert _steps(tmp_path / "trajectories.rewound-3.2.jsonl") == [3, 3]


def test_the_claim_cuts_a_torn_tail_then_moves_the_later_steps(tmp_path):
    """Killed mid-append in step 3's rows after the checkpoint of step 2: the torn line is cut
    (``end_at_last_line``), rows 0..1 stay and read back with no warning, step 2's go aside."""
    _save(tmp_path, 2)
    traj = tmp_path / FILE
    traj.write_text(_rows(range(0, 3)) + '{"step": 2, "index": 2, "resp')
    claim = claim_run_dir(tmp_path, resume=True, steps=10)
    claim.release()
    assert [(r["step"], r["index"]) for r in read_trajectories(tmp_path)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert _steps(tmp_path / "trajectories.rewound-2.jsonl") == [2, 2]


def test_a_start_at_step_0_moves_every_row_and_removes_leftover_temporaries(tmp_path):
    """No checkpoint (a first run killed before it logged a step, started again): every row
    goes to ``trajectories.rewound-0.jsonl``; a temporary file a killed rewind left is removed."""
    traj = tmp_path / FILE
    traj.write_text(_rows(range(0, 1)))
    (tmp_path / ".trajectories.jsonl.tmp").write_text("half")
    claim = claim_run_dir(tmp_path)
    claim.release()
    assert traj.read_text() == ""
    assert _steps(tmp_path / "trajectories.rewound-0.jsonl") == [0, 0]
    assert tmp_path / ".trajectories.jsonl.tmp" in claim.removed

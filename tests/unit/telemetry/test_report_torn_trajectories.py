"""``relayrl report``'s trajectory summary reads ``trajectories.jsonl`` as every reader of the
run's append-only logs does (``relayrl.durable.read_jsonl_log``): a torn last line (an append
a kill cut short) is skipped with a warning, a bad line in the middle names file and line."""

import json
from pathlib import Path

import pytest

from relayrl.telemetry.report import RunData, _trajectory_row


def _run(tmp_path: Path, tail: str) -> RunData:
    rows = [
        {"step": 1, "score": 0.0, "loss_mask": [1, 1, 0]},
        {"step": 1, "score": 1.0, "loss_mask": [1, 0]},
        {"step": 2, "score": 1.0, "loss_mask": [1, 1, 1], "error": "timeout"},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (tmp_path / "trajectories.jsonl").write_text(text, encoding="utf-8")
    return RunData("r", tmp_path, [], [], {}, {})


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run = _run(tmp_path, '{"step": 3, "sco')
    with pytest.warns(UserWarning, match=r"line 4 is torn"):
        row = _trajectory_row(run)
    # 2 steps, 3 trajectories, 6 trained tokens, 1 error; mean score 0.5 -> 1
    assert row == ["r", "2", "3", "6", "1", "0.5 -> 1"]


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path: Path) -> None:
    run = _run(tmp_path, 'not json\n{"step": 3, "score": 1.0}\n')
    with pytest.raises(ValueError, match=r"trajectories.jsonl: line 4 is not valid JSON"):
        _trajectory_row(run)

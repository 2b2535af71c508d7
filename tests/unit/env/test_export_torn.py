"""``read_trajectories`` (env/export.py) after a kill or a power loss mid-append: a torn last
line (no newline after it, does not parse) is skipped with a warning naming the file and line;
a bad line in the middle is an error naming them."""

from __future__ import annotations

import pytest

from relayrl.env.export import FILE, read_trajectories


def test_a_torn_last_trajectory_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / FILE
    path.write_text('{"step": 1, "index": 0}\n{"step": 1, "index": 1}\n{"step": 2, "ind')
    with pytest.warns(UserWarning, match=rf"{path}: line 3 is torn"):
        rows = read_trajectories(tmp_path)
    assert rows == [{"step": 1, "index": 0}, {"step": 1, "index": 1}]


def test_a_bad_trajectory_in_the_middle_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / FILE
    path.write_text('{"step": 1, "index": 0}\n{"step": 1, "ind\n{"step": 2, "index": 0}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_trajectories(tmp_path)

"""Append-only JSONL logs after a kill or a power loss mid-append (``relayrl.durable``):
a final line that does not parse and has no newline after it is a torn append, skipped with a
warning naming the file and line; a bad line anywhere else is an error naming them. Before
anything is appended again, ``end_at_last_line`` cuts the torn line off (or ends a whole
record whose newline was lost), so a torn line never sits in the middle. ``metrics.jsonl``'s
reader and its resume rewrite follow these rules."""

from __future__ import annotations

import pytest

from relayrl.durable import end_at_last_line, read_jsonl_log
from relayrl.telemetry.metrics import MetricsLogger, read_metrics


def test_a_torn_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": ')  # a blank line still counts: line 4
    with pytest.warns(UserWarning, match=rf"{path}: line 4 is torn"):
        assert read_jsonl_log(path) == [(1, {"a": 1}), (3, {"a": 2})]


def test_a_bad_line_with_its_newline_is_an_error_even_when_last(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')  # written whole: not a torn append
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_jsonl_log(path)


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_jsonl_log(path)


def test_a_whole_last_record_without_its_newline_is_read(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')
    assert read_jsonl_log(path) == [(1, {"a": 1}), (2, {"a": 2})]


def test_end_at_last_line_cuts_a_torn_tail_and_ends_a_whole_one(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a"')  # 9 bytes kept, 4 torn
    assert end_at_last_line(path) == f"cut the torn line 2 (4 bytes) off {path}"
    assert path.read_bytes() == b'{"a": 1}\n'
    assert end_at_last_line(path) is None  # ends with a complete line: untouched
    path.write_bytes(b'{"a": 1}\n{"a": 2}')
    assert end_at_last_line(path) == f"ended the unfinished line 2 of {path} with its newline"
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    path.write_bytes(b"\x00" * 5)  # a power loss: the length on disk, not the bytes
    assert end_at_last_line(path) == f"cut the torn line 1 (5 bytes) off {path}"
    assert path.read_bytes() == b""
    assert end_at_last_line(tmp_path / "missing.jsonl") is None


def test_end_at_last_line_finds_the_newline_before_a_tail_longer_than_its_chunk(tmp_path):
    """The tail is searched backwards 64 KiB at a time: a torn record of 200000 bytes after
    two lines is cut at byte 18 (two lines of 9 bytes), and called line 3."""
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n{"x": "' + b"y" * (200_000 - 7))
    assert end_at_last_line(path) == f"cut the torn line 3 (200000 bytes) off {path}"
    assert path.read_bytes() == b'{"a": 1}\n{"a": 2}\n'


def test_read_metrics_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    with pytest.warns(UserWarning, match="line 2 is torn"):
        assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}]
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"\n{"step": 3, "a": 3.0}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not valid JSON"):
        read_metrics(tmp_path)


def test_a_resumed_logger_cuts_the_torn_line_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    with pytest.warns(UserWarning, match="line 3 is torn"):
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    with logger:
        logger.log(3, {"a": 30.0})
    assert path.read_text() == (
        '{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 30.0}\n'
    )

"""``metrics.jsonl`` rewritten on a resume (telemetry/metrics.py: the records after the
checkpoint's step dropped, a torn last line cut) is replaced durably, with
``relayrl.durable``'s helpers: ``.metrics.jsonl.tmp`` fsynced before it is renamed over the
file, the run directory fsynced after the rename."""

from __future__ import annotations

from fsync_log import at, fsynced, record
from relayrl.telemetry.metrics import MetricsLogger, read_metrics


def test_the_resume_rewrite_is_fsynced_before_its_rename_and_the_directory_after(
    tmp_path, monkeypatch
):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"a": float(step)})
    log = record(monkeypatch)
    MetricsLogger(tmp_path, tensorboard=False, resume_step=2).close()
    path, tmp = tmp_path / "metrics.jsonl", tmp_path / ".metrics.jsonl.tmp"
    placed = at(log, "replace", tmp, path)
    assert str(tmp.resolve()) in fsynced(log[:placed])
    assert str(tmp_path.resolve()) in fsynced(log[placed:])
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_nothing_to_drop_writes_and_fsyncs_nothing(tmp_path, monkeypatch):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": 1.0})
    log = record(monkeypatch)
    MetricsLogger(tmp_path, tensorboard=False, resume_step=1).close()
    assert log == []

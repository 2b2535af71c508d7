"""Per-step metrics: one JSON line per step in ``run_dir/metrics.jsonl`` + trackers.

JSON lines are the source of truth (plain, append-only, flushed per line, readable with
``read_metrics``); the trackers (TensorBoard scalars under ``run_dir/tb`` by default, W&B
and MLflow when named: ``relayrl.telemetry.trackers``) are for looking at curves.
"""

from __future__ import annotations

import json
import math
import operator
from pathlib import Path
from typing import IO, Any

from relayrl.durable import read_jsonl_log, write_file_durable
from relayrl.telemetry.trackers import Tracker, TrackerOptions, make_trackers

__all__ = ["METRICS_FILE", "MetricsLogger", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


def _to_float(key: str, value: Any) -> float:
    """A metric value as a Python float: numbers, numpy scalars, one-element tensors."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
    try:
        if hasattr(value, "item"):  # numpy scalar / 0-d array, torch tensor
            value = value.item()
        return float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from e


def _json_value(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _parse_lines(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics file. A torn final line (an append cut short by a kill or a power
    loss: no newline after it) is skipped with a warning; any other bad line is an error
    naming the file and line (``relayrl.durable.read_jsonl_log``)."""
    records = []
    for n, row in read_jsonl_log(path):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {n} is not a JSON object")
        records.append({k: (math.nan if v is None else v) for k, v in row.items()})
    return records


def _replace_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step, durably: a temporary file beside it
    (``.metrics.jsonl.tmp``), fsynced, renamed over ``path``, the directory fsynced
    (``relayrl.durable.write_file_durable``). A crash or a full disk leaves the old file whole
    and no temporary file behind; a power loss, the old file or the new one (one process
    writes a run directory at a time: the trainer holds its lock)."""
    write_file_durable(path, text, tmp=path.with_name(f".{path.name}.tmp"))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` (or a run directory holding one) into a list of dicts.

    ``null`` values (NaN / inf when logged) come back as ``float('nan')``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    return _parse_lines(p)


class MetricsLogger:
    """Log ``{"step": step, **metrics}`` per step to JSONL and the trackers.

    Args:
        run_dir: directory of the run (created if missing).
        tensorboard: also write scalars to ``run_dir/tb`` with ``SummaryWriter`` (used when
            ``backends`` is None).
        backends: the trackers to write to (``tensorboard``, ``wandb``, ``mlflow``); None:
            ``["tensorboard"]`` if ``tensorboard`` else none.
        run_name: the trackers' run name (default: the run directory's name).
        config: the run's resolved config (a plain dict), sent to the trackers at start.
        options: W&B project / mode, MLflow URI (``TrackerOptions``).
        resume_step: when resuming from a checkpoint taken at this step, existing records
            with a larger step (logged after the checkpoint by the interrupted run) are
            dropped so the file holds each step once. ``None`` keeps existing records.
            The file is then replaced atomically and durably (fsynced), and only if that
            changes it (dropped records, a torn last line cut off); one process writes a run
            directory at a time (the trainer holds its lock).

    Values are stored as floats; NaN and +-inf are written as JSON ``null``. ``history``
    holds the records of the file (existing ones first), values as logged.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        resume_step: int | None = None,
        *,
        backends: list[str] | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        options: TrackerOptions | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.history: list[dict[str, Any]] = []
        if self.path.exists():
            self.history = _parse_lines(self.path)
            if resume_step is not None:
                self.history = [r for r in self.history if r.get("step", 0) <= resume_step]
            # Rewrite so a torn last line or dropped steps never precede new records.
            text = "".join(json.dumps(self._encode(r)) + "\n" for r in self.history)
            if text.encode("utf-8") != self.path.read_bytes():
                _replace_atomically(self.path, text)
        if backends is None:
            backends = ["tensorboard"] if tensorboard else []
        self.trackers: list[Tracker] = make_trackers(
            self.run_dir,
            backends,
            run_name=run_name,
            config=config,
            resume_step=resume_step,
            options=options,
        )
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    @staticmethod
    def _encode(record: dict[str, Any]) -> dict[str, Any]:
        return {
            k: _json_value(float(v))
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            else v
            for k, v in record.items()
        }

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one record for ``step`` (flushed at once) and send it to the trackers."""
        if self._file is None:
            raise RuntimeError("MetricsLogger is closed")
        try:
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)  # ints and numpy integers
        except TypeError:
            raise TypeError(f"step must be an int, got {step!r}") from None
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric name {key!r} is not a str")
            if key == "step":
                raise ValueError("'step' is reserved: pass it as the step argument")
            values[key] = _to_float(key, value)
        record: dict[str, Any] = {"step": step, **values}
        line = json.dumps({"step": step, **{k: _json_value(v) for k, v in values.items()}})
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: say which file (a write error names none)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        self.history.append(record)
        for tracker in self.trackers:
            tracker.log(step, values)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Send the end-of-run summary (name -> number) to the trackers, at the last step."""
        if self._file is None:
            raise RuntimeError("MetricsLogger is closed")
        values = {k: _to_float(k, v) for k, v in summary.items()}
        step = max((int(r.get("step", 0)) for r in self.history), default=0)
        for tracker in self.trackers:
            tracker.log_summary(values, step)

    def flush(self) -> None:
        """Flush the JSONL file and the trackers."""
        if self._file is not None:
            self._file.flush()
        for tracker in self.trackers:
            tracker.flush()

    def close(self, failed: bool = False) -> None:
        """Flush and close every output (``failed``: mark the tracker runs failed); safe to
        call twice. A tracker that fails to close does not keep the others open."""
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self.trackers = self.trackers, []
        errors: list[BaseException] = []
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:  # close the rest, then raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)

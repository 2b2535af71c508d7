"""Progress over training steps: a rich bar on a terminal, plain lines in logs.

On a terminal ``StepProgress`` draws a live rich bar with a few key metrics. When the console
is not a terminal (output redirected to a file: CI, ``nohup``, a cluster job), a live bar
prints nothing until it ends, so instead a plain, flushed line is written on the first step,
then at most every ``interval_s`` seconds, and on the last step::

    sft step 40/1500 (3%) elapsed 0:00:12 eta 0:07:18 loss=1.23

``log_file`` (for example ``run_dir/progress.log``) receives the same lines, each prefixed
with a UTC timestamp, whether or not the console is a terminal. The interval defaults to
``$RELAYRL_PROGRESS_INTERVAL_S`` or 30 s.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import IO, Any

from rich import get_console
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = [
    "DEFAULT_INTERVAL_S",
    "INTERVAL_ENV",
    "StepProgress",
    "format_duration",
    "format_fields",
    "progress_interval",
]

DEFAULT_INTERVAL_S = 30.0
INTERVAL_ENV = "RELAYRL_PROGRESS_INTERVAL_S"


def _now() -> float:
    """The clock of elapsed times and intervals (monotonic; a seam for tests)."""
    return time.monotonic()


def progress_interval() -> float:
    """Seconds between plain progress lines: ``$RELAYRL_PROGRESS_INTERVAL_S`` or 30."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: must be a number of seconds >= 0") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: must be a number of seconds >= 0")
    return value


def format_fields(fields: dict[str, Any]) -> str:
    """``reward=0.512 pass=0.75`` - floats to 3 significant digits, others as str."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.3g}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``?`` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class StepProgress:
    """Progress over ``total`` steps: ``with StepProgress(100, "grpo") as bar:
    bar.update(step, reward=0.4, pass_rate=0.3)``.

    ``enabled=False`` silences the console (quiet runs, tests, non-root ranks); ``log_file``
    is still written. ``console`` defaults to rich's global console (stdout). ``interval_s``
    (default ``progress_interval()``) spaces the plain lines written when the console is not
    a terminal and the lines of ``log_file``; the first and the last step are always written.
    ``initial``: steps done before this process (a resumed run): the count goes on from it
    (``step 41/85``, not ``step 1/45``), and the rate behind the ETA is this process's own.
    """

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool = True,
        console: Console | None = None,
        interval_s: float | None = None,
        log_file: str | Path | None = None,
        initial: int = 0,
    ) -> None:
        self.total = total
        self.initial = initial
        self.description = description
        self.enabled = enabled
        self.interval_s = progress_interval() if interval_s is None else float(interval_s)
        self.log_file = Path(log_file) if log_file is not None else None
        self.last_fields: dict[str, Any] = {}
        self.lines: list[str] = []
        """Plain lines written so far (console or log file), without timestamps."""
        self._console = console or get_console()
        self._plain = enabled and not (self._console.is_terminal or self._console.is_jupyter)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._log: IO[str] | None = None
        self._t0 = _now()
        self._last_line = -math.inf  # monotonic time of the last plain line
        self._step = initial
        self._written_step = -1  # step of the last plain line
        if enabled and not self._plain:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("<"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
            )
            self._task = self._progress.add_task(
                description, total=total, completed=initial, info=""
            )

    @property
    def plain(self) -> bool:
        """True when the console gets plain lines instead of a live bar."""
        return self._plain

    def start(self) -> None:
        """Start rendering and the clock (called by ``__enter__``)."""
        self._t0 = _now()
        if self.log_file is not None and self._log is None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_file.open("a", encoding="utf-8")
        if self._progress is not None:
            self._progress.start()

    def stop(self) -> None:
        """Stop rendering: leave the final bar on screen, write the last step's line if it was
        not written yet (a loop that ended early), close ``log_file`` (``__exit__``)."""
        if self._progress is not None:
            self._progress.stop()
        if self._step > max(self._written_step, self.initial):
            self._write_line()
        if self._log is not None:
            self._log.close()
            self._log = None

    def update(self, step: int, **fields: Any) -> None:
        """Mark ``step`` steps done and show ``fields`` (keep it to a few key metrics)."""
        self.last_fields = fields
        self._step = step
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, info=format_fields(fields))
        if not (self._plain or self._log is not None):
            return
        now = _now()
        if self._written_step < 0 or step >= self.total or now - self._last_line >= self.interval_s:
            self._write_line(now)

    def line(self, now: float | None = None) -> str:
        """``sft step 40/1500 (3%) elapsed 0:00:12 eta 0:07:18 loss=1.23``."""
        elapsed = (_now() if now is None else now) - self._t0
        step, total = self._step, self.total
        done_here = step - self.initial
        eta = elapsed / done_here * (total - step) if done_here > 0 else math.nan
        pct = f" ({100 * step // total}%)" if total > 0 else ""
        info = format_fields(self.last_fields)
        text = (
            f"{self.description} step {step}/{total}{pct} elapsed {format_duration(elapsed)} "
            f"eta {format_duration(eta)}"
        )
        return f"{text} {info}" if info else text

    def _write_line(self, now: float | None = None) -> None:
        now = _now() if now is None else now
        text = self.line(now)
        self.lines.append(text)
        self._last_line = now
        self._written_step = self._step
        if self._plain:
            out = self._console.file
            out.write(text + "\n")
            out.flush()
        if self._log is not None:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self._log.write(f"{stamp} {text}\n")
            self._log.flush()

    def __enter__(self) -> StepProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

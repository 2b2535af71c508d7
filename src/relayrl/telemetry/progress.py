"""A thin rich progress bar over training steps that shows a few key metrics."""

from __future__ import annotations

from typing import Any

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

__all__ = ["StepProgress", "format_fields"]


def format_fields(fields: dict[str, Any]) -> str:
    """``reward=0.512 pass=0.75`` - floats to 3 significant digits, others as str."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.3g}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


class StepProgress:
    """Progress over ``total`` steps: ``with StepProgress(100, "grpo") as bar:
    bar.update(step, reward=0.4, pass_rate=0.3)``.

    With ``enabled=False`` every method is a no-op (for quiet runs, tests, non-root ranks).
    ``console`` defaults to rich's (stderr-aware) global console.
    """

    def __init__(
        self,
        total: int,
        description: str,
        enabled: bool = True,
        console: Console | None = None,
    ) -> None:
        self.total = total
        self.description = description
        self.enabled = enabled
        self.last_fields: dict[str, Any] = {}
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
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
            self._task = self._progress.add_task(description, total=total, info="")

    def start(self) -> None:
        """Start rendering (called by ``__enter__``)."""
        if self._progress is not None:
            self._progress.start()

    def stop(self) -> None:
        """Stop rendering and leave the final bar on screen (called by ``__exit__``)."""
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, **fields: Any) -> None:
        """Mark ``step`` steps done and show ``fields`` (keep it to a few key metrics)."""
        self.last_fields = fields
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, info=format_fields(fields))

    def __enter__(self) -> StepProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Per-role timelines in Chrome trace format (open in chrome://tracing or ui.perfetto.dev).

Spans are (role, name, start, end) in ``time.perf_counter()`` seconds, which on Linux is a
system-wide monotonic clock, so spans recorded in different processes line up.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self.origin = time.perf_counter()

    def add(self, role: str, name: str, start: float, end: float) -> None:
        with self._lock:
            self.spans.append((role, name, start, end))

    @contextmanager
    def span(self, role: str, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(role, name, t0, time.perf_counter())

    def busy_seconds(self, role: str, name: str | None = None) -> float:
        return sum(e - s for r, n, s, e in self.spans if r == role and (name is None or n == name))

    def to_chrome_trace(self) -> dict[str, object]:
        """{"traceEvents": [...]}: one complete ("X") event per span, one thread per role."""
        roles = sorted({r for r, _, _, _ in self.spans})
        tid = {r: i for i, r in enumerate(roles)}
        events: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[r], "args": {"name": r}}
            for r in roles
        ]
        for role, name, start, end in sorted(self.spans, key=lambda x: x[2]):
            events.append(
                {
                    "name": name,
                    "cat": role,
                    "ph": "X",
                    "pid": 0,
                    "tid": tid[role],
                    "ts": (start - self.origin) * 1e6,  # microseconds
                    "dur": max(end - start, 0.0) * 1e6,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_chrome_trace()))
        tmp.replace(p)
        return p

"""Hold a Tinker service's worker inside an ``optim_step`` so the requests a test sends next
queue behind it in a known order (events, no sleeps): ``held_worker(server, monkeypatch)``
yields the queue of submitted request ids (one per request, in the order submitted) and the
event set once the worker is in the step; leaving the block lets the step go on."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Held:
    queued: queue.Queue[str] = field(default_factory=queue.Queue)
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def next_queued(self) -> str:
        """The id of the next request the worker was handed (waits up to 60 s)."""
        return self.queued.get(timeout=60)


@contextmanager
def held_worker(server: Any, monkeypatch: Any) -> Iterator[Held]:
    """Patch ``server``'s worker to note each submitted request and its service's
    ``optim_step`` to wait on ``release``; on exit ``release`` is set (also on failure)."""
    held = Held()
    submit = server.worker.submit
    optim_step = server.service.optim_step

    def noting_submit(*args: Any, **kwargs: Any) -> str:
        rid = submit(*args, **kwargs)
        held.queued.put(rid)
        return rid

    def held_step(model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        held.started.set()
        assert held.release.wait(60), "the held optim_step was never released"
        return optim_step(model_id, adam)

    monkeypatch.setattr(server.worker, "submit", noting_submit)
    monkeypatch.setattr(server.service, "optim_step", held_step)
    try:
        yield held
    finally:
        held.release.set()

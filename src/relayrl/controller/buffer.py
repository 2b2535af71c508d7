"""The sample buffer between the rollout controller and the trainer.

Finished, scored groups are consumed oldest-first by submission (admission) order, each exactly
once. ``take`` blocks until enough groups are ready, waking early on an error or a stop.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from relayrl.rollout import Sample


@dataclass(order=True)
class ScoredGroup:
    admission_index: int
    samples: list[Sample] = field(compare=False)
    scores: Tensor = field(compare=False)


class GroupBuffer:
    def __init__(self) -> None:
        self._heap: list[ScoredGroup] = []
        self._cv = threading.Condition()
        self.total_put = 0
        self.total_taken = 0

    def put(self, group: ScoredGroup) -> None:
        with self._cv:
            heapq.heappush(self._heap, group)
            self.total_put += 1
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def take(
        self, n: int, check: Callable[[], None] | None = None, poll_s: float = 0.5
    ) -> list[ScoredGroup]:
        """Block until ``n`` groups are ready; return the ``n`` oldest. ``check`` may raise."""
        with self._cv:
            while len(self._heap) < n:
                if check is not None:
                    check()
                self._cv.wait(timeout=poll_s)
            out = [heapq.heappop(self._heap) for _ in range(n)]
            self.total_taken += n
            return out

    def wait_time(
        self, n: int, check: Callable[[], None] | None = None
    ) -> tuple[list[ScoredGroup], float]:
        t0 = time.perf_counter()
        out = self.take(n, check)
        return out, time.perf_counter() - t0

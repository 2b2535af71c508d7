"""The sample buffer between the rollout controller and the trainer.

Finished, scored groups are consumed oldest-first by submission (admission) order, each exactly
once. ``take`` blocks until enough groups are ready, waking early on an error or a stop.

``in_order=True``: a take returns exactly the next ``n`` admitted groups, waiting for a
straggler among them (step s trains the groups admitted for step s, so with the staleness gate
every token is at most eta versions old); groups the controller dropped (dynamic sampling:
``skip``) are passed over. ``in_order=False``: the ``n`` oldest finished groups
(no wait for stragglers; a straggler is trained at a later step, staler than eta).

What has been consumed is ``next_index`` (every admission id below it was trained or dropped;
it never moves backwards) plus ``taken_above``, the ids above it already trained: in finish
order a take can run ahead of a straggler, and a checkpoint keeps both so that a resumed run
trains the straggler and nothing twice.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from relayrl.rollout import Sample


@dataclass(order=True)
class ScoredGroup:
    admission_index: int
    samples: list[Sample] = field(compare=False)
    scores: Tensor = field(compare=False)


class GroupBuffer:
    def __init__(self, in_order: bool = False, next_index: int = 0) -> None:
        self._heap: list[ScoredGroup] = []
        self._cv = threading.Condition()
        self.in_order = in_order
        self.next_index = next_index
        self.taken_above: set[int] = set()  # ids > next_index already trained (finish order)
        self.total_put = 0
        self.total_taken = 0
        self._skipped: set[int] = set()  # admission indices that will never arrive
        self._blocked_on: int | None = None  # n of a take waiting now

    def rebase(self, next_index: int, taken_above: Iterable[int] = ()) -> None:
        """After a resume: every id below ``next_index`` and those in ``taken_above`` were
        trained before the checkpoint."""
        with self._cv:
            self.next_index = next_index
            self.taken_above = {int(i) for i in taken_above if int(i) > next_index}
            self._skipped.clear()

    def skip(self, admission_index: int) -> None:
        """The group with this admission index was dropped: in-order takes pass over it."""
        with self._cv:
            self._skipped.add(admission_index)
            self._cv.notify_all()

    def _expected(self, n: int) -> list[int]:
        """The next ``n`` admission indices to train in order, skipping dropped groups."""
        out: list[int] = []
        idx = self.next_index
        while len(out) < n:
            if idx not in self._skipped:
                out.append(idx)
            idx += 1
        return out

    def _ready(self, n: int) -> bool:
        if len(self._heap) < n:
            return False
        if not self.in_order:
            return True
        front = heapq.nsmallest(n, self._heap)
        return [g.admission_index for g in front] == self._expected(n)

    def waiting_for(self) -> list[int]:
        """In order: the admission indices a blocked ``take`` still lacks ([] when none waits
        or in finish order, where any finished group will do)."""
        with self._cv:
            if not self.in_order or self._blocked_on is None:
                return []
            have = {g.admission_index for g in self._heap}
            return [i for i in self._expected(self._blocked_on) if i not in have]

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
            self._blocked_on = n
            try:
                while not self._ready(n):
                    if check is not None:
                        check()
                    self._cv.wait(timeout=poll_s)
            finally:
                self._blocked_on = None
            out = [heapq.heappop(self._heap) for _ in range(n)]
            self.total_taken += n
            self.taken_above.update(g.admission_index for g in out)
            self._advance()
            return out

    def _advance(self) -> None:
        """Move ``next_index`` over every id now trained or dropped (never backwards)."""
        done = self.taken_above | self._skipped
        while self.next_index in done:
            self.next_index += 1
        self.taken_above = {i for i in self.taken_above if i > self.next_index}
        self._skipped = {i for i in self._skipped if i >= self.next_index}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: ``next_group`` and ``trained_above`` (sorted ids)."""
        with self._cv:
            return {"next_group": self.next_index, "trained_above": sorted(self.taken_above)}

    def wait_time(
        self, n: int, check: Callable[[], None] | None = None
    ) -> tuple[list[ScoredGroup], float]:
        t0 = time.perf_counter()
        out = self.take(n, check)
        return out, time.perf_counter() - t0

"""The service's one worker thread and the futures the SDK polls.

A request that does work (create_model, forward_backward, optim_step, save / load, sample) is
queued here and answered at once with a request id (the SDK's ``UntypedAPIFuture``); the SDK
then long-polls ``/api/v1/retrieve_future`` until the result is there. The queue is FIFO and
unbounded: an overloaded service answers later, it never drops a request (the SDK keeps
polling through ``try_again``). Queued sample requests are taken together, so requests sent
concurrently (a group of rollouts) share one engine batch: a sample request runs ahead of the
training jobs queued before it (they cannot change what a sampler serves), never ahead of a
``barrier`` job (a named ``save_weights_for_sampler``, a delete), which can: a sample request
is served by the weights its sampler's path names when the request arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.tinker.sampling import SampleJob

Result = bytes | dict[str, Any] | Exception
KEEP_RESULTS_S = 600.0
SAMPLE_GATHER_S = 0.005
"""How long a lone sample request waits for others to join its engine batch."""


@dataclass
class _Job:
    request_id: str
    fn: Callable[[], Result] | None
    sample: SampleJob | None
    barrier: bool = False
    """Sample jobs queued after this one wait for it (it changes what a sampler serves)."""


class Worker:
    """Runs jobs in order on one thread; results land in asyncio futures of ``loop``."""

    def __init__(self, sample_batch: Callable[[list[SampleJob]], Sequence[Result]]) -> None:
        self._sample_batch = sample_batch
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._futures: dict[str, asyncio.Future[Result]] = {}
        self._done_at: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tinker-worker", daemon=True)
        self._thread.start()

    def submit(
        self,
        fn: Callable[[], Result] | None = None,
        sample: SampleJob | None = None,
        barrier: bool = False,
    ) -> str:
        """Queue a job (call from the event loop); its request id. ``barrier``: no sample job
        queued after it runs before it."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        rid = f"req-{next(self._ids)}"
        self._futures[rid] = loop.create_future()
        self._prune()
        with self._cv:
            self._queue.append(_Job(rid, fn, sample, barrier))
            self._cv.notify()
        return rid

    def queued(self) -> int:
        return len(self._queue)

    async def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None if still pending after ``timeout`` s; KeyError if unknown."""
        fut = self._futures[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            return None

    def _prune(self) -> None:
        now = time.monotonic()
        for rid, t in list(self._done_at.items()):
            if now - t > KEEP_RESULTS_S:
                self._futures.pop(rid, None)
                self._done_at.pop(rid, None)

    def _finish(self, rid: str, result: Result) -> None:
        fut = self._futures.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(result)
        self._done_at[rid] = time.monotonic()

    def _deliver(self, rid: str, result: Result) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._finish, rid, result)

    def _take(self) -> list[_Job] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            first = self._queue.popleft()
            if first.sample is None:
                return [first]
            if not any(j.sample is not None for j in self._queue):
                # requests sent together reach the server a little apart: wait a moment
                # for the rest of the group, so that they share one engine batch
                self._cv.wait(SAMPLE_GATHER_S)
            # the sample jobs queued before the first barrier read what their samplers serve
            # now: running them ahead of the training jobs between changes no result; those
            # behind a barrier (a named sampler save, a delete) wait for it
            batch, rest, behind = [first], deque[_Job](), False
            for j in self._queue:
                behind = behind or j.barrier
                if j.sample is not None and not behind:
                    batch.append(j)
                else:
                    rest.append(j)
            self._queue = rest
            return batch

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            if jobs[0].sample is None:
                fn = jobs[0].fn
                assert fn is not None
                try:
                    result: Result = fn()
                except Exception as e:  # noqa: BLE001 - the SDK gets it as a failed request
                    result = e
                self._deliver(jobs[0].request_id, result)
                continue
            try:
                results = self._sample_batch([j.sample for j in jobs if j.sample is not None])
            except Exception as e:  # noqa: BLE001
                results = [e] * len(jobs)
            for job, res in zip(jobs, results, strict=True):
                self._deliver(job.request_id, res)

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

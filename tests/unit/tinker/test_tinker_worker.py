"""The Tinker service's worker: queued sample requests share a batch and run ahead of the
training jobs queued between them, never ahead of a barrier (a named sampler save, a delete).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from relayrl.tinker.sampling import SampleJob
from relayrl.tinker.worker import Worker


def _sample(name: str) -> SampleJob:
    return SampleJob(name, [1], 1, {})


def test_samples_batch_past_training_jobs_but_not_past_a_barrier() -> None:
    ran: list[Any] = []
    started, release = threading.Event(), threading.Event()

    def batch(jobs: list[SampleJob]) -> list[bytes]:
        ran.append(sorted(j.sampler_id for j in jobs))
        return [b""] * len(jobs)

    def job(name: str) -> Any:
        def fn() -> dict[str, Any]:
            ran.append(name)
            return {}

        return fn

    def hold() -> dict[str, Any]:
        started.set()
        assert release.wait(60)
        return {}

    async def run() -> None:
        worker = Worker(batch)
        try:
            rids = [worker.submit(hold)]
            assert await asyncio.to_thread(started.wait, 60)  # queued from here on
            rids += [
                worker.submit(sample=_sample("a")),
                worker.submit(job("train")),
                worker.submit(sample=_sample("b")),
                worker.submit(job("save latest"), barrier=True),
                worker.submit(sample=_sample("c")),
                worker.submit(job("train 2")),
                worker.submit(sample=_sample("d")),
            ]
            release.set()
            for rid in rids:
                assert await worker.wait(rid, 60) is not None
        finally:
            release.set()
            worker.close()

    asyncio.run(run())
    assert ran == [["a", "b"], "train", "save latest", ["c", "d"], "train 2"]

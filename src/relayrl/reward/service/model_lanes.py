"""The reward service's model lanes: batched in-process scorers (a reward model, a judge).

Each lane is one thread that batches what arrives: a batch closes when it holds
``batch_size`` jobs or ``max_wait_s`` after its first job arrived. A scorer that raises, or
returns the wrong number of scores, fails that component of every sample in the batch; a
score that is not a number (or NaN) fails that sample's component only.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from relayrl.reward.service.worker_pool import Job

__all__ = ["ModelLane", "ModelScorer", "model_value", "run_inline"]


@runtime_checkable
class ModelScorer(Protocol):
    """A batched, in-process scorer (a reward model, a judge): ``relayrl.reward.scorer.
    BatchScorer``. Per completion a float, or a dict of named components with a ``"score"``."""

    def score_batch(
        self, prompts: Sequence[str], completions: Sequence[str], samples: Sequence[dict]
    ) -> Sequence[float | dict[str, float]]: ...


class ModelLane:
    """One model scorer in a thread, batching what arrives within ``max_wait_s``."""

    def __init__(
        self,
        name: str,
        scorer: ModelScorer,
        weight: float,
        batch_size: int,
        max_wait_s: float,
        on_done: Callable[[Job, str, float, dict[str, float], str | None], None],
    ) -> None:
        self.name, self.scorer, self.weight = name, scorer, weight
        self.batch_size, self.max_wait_s = batch_size, max_wait_s
        self.on_done = on_done
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"reward-{name}")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            stop = False
            while len(batch) < self.batch_size:
                try:
                    nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self.run(batch)
            if stop:
                return

    def run(self, batch: list[Job]) -> None:
        self.batches += 1
        try:
            outs = list(
                self.scorer.score_batch(
                    [j.prompt for j in batch],
                    [j.completion for j in batch],
                    [j.fields for j in batch],
                )
            )
            if len(outs) != len(batch):
                raise ValueError(f"returned {len(outs)} scores for {len(batch)} samples")
        except Exception as e:
            for j in batch:
                self.on_done(j, self.name, math.nan, {}, f"{self.name}: {type(e).__name__}: {e}")
            return
        for j, out in zip(batch, outs, strict=True):
            try:
                value, extra = model_value(out)
                self.on_done(j, self.name, value, extra, None)
            except Exception as e:
                self.on_done(j, self.name, math.nan, {}, f"{self.name}: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=30)


def model_value(out: Any) -> tuple[float, dict[str, float]]:
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError("scorer returned a dict without 'score'")
        extra = {str(k): float(v) for k, v in out.items() if k != "score"}
        value = float(out["score"])
    else:
        if isinstance(out, (str, bytes)):
            raise TypeError(f"scorer returned a {type(out).__name__}")
        value, extra = float(out.item() if hasattr(out, "item") else out), {}
    if math.isnan(value):
        raise ValueError("scorer returned NaN")
    return value, extra


def run_inline(
    name: str, scorer: Any, weight: float, jobs: list[Job], on_done: Callable[..., None]
) -> None:
    if not jobs:
        return
    lane = ModelLane.__new__(ModelLane)
    lane.name, lane.scorer, lane.weight, lane.on_done, lane.batches = (
        name,
        scorer,
        weight,
        on_done,
        0,
    )
    lane.run(jobs)

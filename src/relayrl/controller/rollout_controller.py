"""AReaL's rollout controller: keeps the engine fed under the staleness gate.

Runs as a thread beside the trainer. It admits prompt groups while the gate allows
(floor((N_r - 1) / B) <= i + eta), collects finished samples from the engine worker, scores
each sample as it arrives (off the generation path: the engine runs in its own process), and
hands complete groups to the buffer in admission order. Group g uses the prompts the sync
schedule would use at step g // B, so eta = 0 reproduces sync semantics on separate workers.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from relayrl.config import RunConfig
from relayrl.controller.algorithms import group_requests
from relayrl.controller.buffer import GroupBuffer, ScoredGroup
from relayrl.controller.prompts import PromptSource, TokenizedPrompt
from relayrl.controller.staleness import StalenessGate
from relayrl.rollout import Sample
from relayrl.telemetry.timeline import Timeline
from relayrl.workers.reward import RewardWorker


class RolloutController(threading.Thread):
    def __init__(
        self,
        engine: Any,
        source: PromptSource,
        reward: RewardWorker,
        cfg: RunConfig,
        gate: StalenessGate,
        buffer: GroupBuffer,
        stop_ids: list[int],
        timeline: Timeline,
    ):
        super().__init__(daemon=True, name="rollout-controller")
        self.engine = engine
        self.source = source
        self.reward = reward
        self.cfg = cfg
        self.gate = gate
        self.buffer = buffer
        self.stop_ids = stop_ids
        self.timeline = timeline
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[Sample, float]]] = {}
        self._prompt_cache: dict[int, list[TokenizedPrompt]] = {}
        self.samples_received = 0
        self.samples_interrupted = 0
        self.groups_completed = 0
        # Never flood the engine beyond what keeps its slots busy (this is also what bounds
        # an unbounded eta): at most 2 x slots worth of groups unfinished, and at least B.
        slots = int(getattr(getattr(engine, "spec", None), "max_slots", cfg.rollout.max_slots))
        per_group = cfg.algo.group_size
        self._capacity = max(cfg.algo.prompts_per_step, -(-2 * slots // per_group))

    # ---------------------------------------------------------------- trainer side
    def set_version(self, version: int) -> None:
        with self._lock:
            self.gate.set_version(version)

    def stop(self) -> None:
        self._halt.set()

    def check(self) -> None:
        """Raise in the trainer thread if the controller failed (e.g. the engine died)."""
        if self.error is not None:
            raise self.error

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        self._start_admitted = self.gate.n_admitted  # after a resume the gate is re-based
        try:
            while not self._halt.is_set():
                self._admit()
                for s in self.engine.poll(timeout=self.cfg.async_.poll_interval_s):
                    self._score(s)
                if self.reward.service is not None:
                    for s, result in self.reward.service.poll():
                        self._collect(s, result.score)
        except BaseException as exc:  # surfaced to the trainer through check()
            self.error = exc
            self.buffer.wake()

    def _in_flight(self) -> int:
        """Admitted groups not yet complete (in the engine or being scored)."""
        return self.gate.n_admitted - self._start_admitted - self.groups_completed

    def _prompts_for_step(self, step: int) -> list[TokenizedPrompt]:
        if step not in self._prompt_cache:
            self._prompt_cache[step] = self.source.for_step(step, self.cfg.algo.prompts_per_step)
            for old in [k for k in self._prompt_cache if k < step - 8]:
                del self._prompt_cache[old]
        return self._prompt_cache[step]

    def _admit(self) -> None:
        b = self.cfg.algo.prompts_per_step
        batch = []
        with self._lock:
            while self.gate.can_admit() and self._in_flight() < self._capacity:
                g = self.gate.n_admitted
                step, index = divmod(g, b)
                prompt = self._prompts_for_step(step)[index]
                batch.extend(group_requests(prompt, self.cfg, step, index, g, self.stop_ids))
                self.gate.admit()
        if batch:
            self.engine.submit_many(batch)

    def _score(self, sample: Sample) -> None:
        """Score as the sample finishes: in the reward service's process pool when there is
        one (results come back through ``poll``), else inline in this thread."""
        self.samples_received += 1
        if self.reward.service is not None:
            self.reward.service.submit(sample)
            return
        t0 = time.perf_counter()
        score, _ = self.reward.score([sample])
        self.timeline.add("reward", "score", t0, time.perf_counter())
        self._collect(sample, float(score[0]))

    def _collect(self, sample: Sample, score: float) -> None:
        self.samples_interrupted += int(sample.num_interrupts > 0)
        g = int(sample.group_id) if sample.group_id is not None else -1
        group = self._pending.setdefault(g, [])
        group.append((sample, score))
        if len(group) == self.cfg.algo.group_size:
            del self._pending[g]
            self.groups_completed += 1
            group.sort(key=lambda x: x[0].metadata.get("sample_index", 0))
            self.buffer.put(
                ScoredGroup(
                    g,
                    [s for s, _ in group],
                    torch.tensor([sc for _, sc in group], dtype=torch.float32),
                )
            )

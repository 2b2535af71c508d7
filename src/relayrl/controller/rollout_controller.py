"""AReaL's rollout controller: keeps the engine fed under the staleness gate.

Runs as a thread beside the trainer. It admits prompt groups while the gate allows
(floor((N_r - 1) / B) <= i + eta), collects finished samples from the engine worker, scores
each sample as it arrives (off the generation path: the engine runs in its own process), and
hands complete groups to the buffer in admission order. Group g uses the prompts the sync
schedule would use at step g // B, so eta = 0 reproduces sync semantics on separate workers.

A sample that failed for infrastructure reasons (``controller.failures``) is generated again,
same request, up to ``failures.retries`` times before it joins its group (the trainer then
leaves it out); a request the engine refuses (``rejected()``) is such a failure (``engine``).
A group that failures leave with fewer than 2 samples is given back to the gate as dynamic
sampling gives back a group without signal, so a fresh prompt's group replaces it
(``failures.regenerate_rounds`` x B per trainer version; past that the trainer drops it).
A trainer that waits while nothing finished for ``failures.stall_s`` gets
:class:`RolloutStalled` naming what is in flight, never a silent hang.
"""

from __future__ import annotations

import threading
import time

import torch

from relayrl.config import RunConfig
from relayrl.controller.algorithms import group_requests
from relayrl.controller.buffer import GroupBuffer, ScoredGroup
from relayrl.controller.dynamic_sampling import group_outcomes
from relayrl.controller.failures import infra_cause, small_groups
from relayrl.controller.staleness import StalenessGate
from relayrl.controller.watchdog import RolloutStalled
from relayrl.data.dynamic import has_signal
from relayrl.data.prompts import PromptSource, TokenizedPrompt
from relayrl.env.scoring import scoring_view
from relayrl.reward import Scorer
from relayrl.rollout import GenerationRequest, PollingBackend, Sample, error_sample
from relayrl.telemetry.timeline import Timeline


class RolloutController(threading.Thread):
    def __init__(
        self,
        engine: PollingBackend,
        source: PromptSource,
        reward: Scorer,
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
        self._views: dict[int, Sample] = {}  # id(scoring view in the service) -> its sample
        self._prompt_cache: dict[int, list[TokenizedPrompt]] = {}
        self.groups_completed = 0  # kept or dropped
        self.groups_dropped = 0
        self.groups_regenerated = 0  # too small after failures: replaced by a fresh group
        self.samples_retried = 0  # infrastructure failures generated again
        self._attempts: dict[tuple[int, int], int] = {}  # (group, sample index) -> retries
        self._last_progress = time.monotonic()
        # Admission ids (group ids, prompt positions, buffer order) run on past the gate's
        # count when dynamic sampling gives dropped groups back to the gate.
        self._next_id = gate.n_admitted
        self._start_id = gate.n_admitted
        self._trained: set[int] = set()  # ids above _next_id trained before a resume
        self._passed_over = 0  # ids not admitted because they were trained before
        self._drops_at_version = 0
        self._regens_at_version = 0
        self._urgent: list[int] = []  # the groups the engine was last told the trainer awaits
        # Never flood the engine beyond what keeps its slots busy (this is also what bounds
        # an unbounded eta): at most 2 x slots worth of groups unfinished, and at least B.
        slots = engine.max_slots
        slots = cfg.rollout.max_slots if slots is None else slots
        per_group = cfg.algo.group_size
        self._capacity = max(cfg.algo.prompts_per_step, -(-2 * slots // per_group))

    # ---------------------------------------------------------------- trainer side
    def set_version(self, version: int) -> None:
        with self._lock:
            self.gate.set_version(version)
            self._drops_at_version = 0
            self._regens_at_version = 0
        self._last_progress = time.monotonic()  # the gate opens: a fresh start for stalls

    def stop(self) -> None:
        self._halt.set()

    def rebase(self, next_id: int, trained_above: list[int] | None = None) -> None:
        """Admission ids continue at ``next_id`` (a resumed run), and the buffer's takes with
        them, passing over the ids in ``trained_above`` (finish order: trained before the
        checkpoint while a straggler below them was still in flight); call before ``start``."""
        with self._lock:
            self._next_id = self._start_id = next_id
            self._trained = {i for i in trained_above or () if i >= next_id}
            self._passed_over = 0
        self.buffer.rebase(next_id, self._trained)

    def check(self) -> None:
        """Raise in the trainer thread if the controller failed (e.g. the engine died)."""
        if self.error is not None:
            raise self.error
        stall = self.cfg.failures.stall_s
        idle = time.monotonic() - self._last_progress
        if stall is not None and idle > stall:
            raise RolloutStalled(
                f"rollout stalled: no sample finished generating or scoring for {idle:.0f} s "
                f"(failures.stall_s={stall:g}); in flight: {self._in_flight()} groups admitted "
                f"to the engine, {len(self._views)} samples awaiting the reward service"
            )

    # ---------------------------------------------------------------- the loop
    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._admit()
                self._prioritize_awaited()
                for s in self.engine.poll(timeout=self.cfg.async_.poll_interval_s):
                    self._score(s)
                for request, error in self.engine.rejected():
                    self._refused(request, error)
                if self.reward.service is not None:
                    for view, result in self.reward.service.poll():
                        self._collect_scored(view, result.score)
        except BaseException as exc:  # surfaced to the trainer through check()
            self.error = exc
            self.buffer.wake()

    def _prioritize_awaited(self) -> None:
        """Tell the engine which groups the blocked in-order trainer still waits for (their
        stragglers then also decode alone: ``async.urgent_steps``), and when it stops waiting."""
        if not self.cfg.async_.urgent_steps:
            return
        awaited = self.buffer.waiting_for()
        if awaited != self._urgent:
            self.engine.prioritize(awaited)
            self._urgent = awaited

    def _in_flight(self) -> int:
        """Admitted groups not yet complete (in the engine or being scored)."""
        return self._next_id - self._start_id - self._passed_over - self.groups_completed

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
                g = self._next_id
                if g in self._trained:  # trained before the resume: never generated again
                    self._trained.discard(g)
                    self._next_id += 1
                    self._passed_over += 1
                    continue
                step, index = divmod(g, b)
                prompt = self._prompts_for_step(step)[index]
                batch.extend(group_requests(prompt, self.cfg, step, index, g, self.stop_ids))
                self.gate.admit()
                self._next_id += 1
        if batch:
            self.engine.submit_many(batch)

    def _drop_without_signal(self, g: int, group: list[tuple[Sample, float]]) -> bool:
        """Dynamic sampling (DAPO) as groups finish: a group whose raw outcomes are all equal
        carries no GRPO signal; it is dropped, given back to the staleness gate (a
        replacement is admitted) and skipped by the buffer. At most (max_rounds - 1) x B
        drops per trainer version, so an all-solved (or all-failed) phase cannot starve the
        trainer: past that, such groups are trained as they are."""
        ds = self.cfg.data.dynamic_sampling
        if not ds.enabled or has_signal(group_outcomes(group)):
            return False
        with self._lock:
            if self._drops_at_version >= (ds.max_rounds - 1) * self.cfg.algo.prompts_per_step:
                return False
            self._drops_at_version += 1
            self.gate.release()
        self.groups_dropped += 1
        self.buffer.skip(g)
        return True

    def _regenerate_small(self, g: int, group: list[tuple[Sample, float]]) -> bool:
        """A group that infrastructure failures left with fewer than 2 samples (GRPO-style
        estimators, without dynamic sampling, which drops it as a group without signal): given
        back to the staleness gate and skipped by the buffer, as dynamic sampling drops a
        group, so the next admission (a fresh prompt) replaces it. At most
        ``failures.regenerate_rounds`` x B per trainer version; past that it goes to the
        trainer, which drops it (``failures/groups_dropped``)."""
        cfg = self.cfg
        if cfg.algo.name == "ppo" or cfg.data.dynamic_sampling.enabled:
            return False
        if not small_groups([s for s, _ in group]):
            return False
        with self._lock:
            if (
                self._regens_at_version
                >= cfg.failures.regenerate_rounds * cfg.algo.prompts_per_step
            ):
                return False
            self._regens_at_version += 1
            self.gate.release()
        self.groups_regenerated += 1
        self.buffer.skip(g)
        return True

    def _score(self, sample: Sample) -> None:
        """Score as the sample finishes: in the reward service's process pool when there is
        one (results come back through ``poll``), else inline in this thread."""
        self._last_progress = time.monotonic()
        if self.reward.service is not None:  # an episode's reward sees its final turn only
            view = scoring_view(sample)
            self._views[id(view)] = sample
            self.reward.service.submit(view)
            return
        t0 = time.perf_counter()
        score, _ = self.reward.score([sample])
        self.timeline.add("reward", "score", t0, time.perf_counter())
        self._collect(sample, float(score[0]))

    def _refused(self, request: GenerationRequest, error: str) -> None:
        """A request the engine refused (``rejected()``: its sample never comes out of
        ``poll``) is the ``'abort'`` sample with ``error`` set that ``generate`` would have
        handed back: an infrastructure failure (``engine``), generated again while it has
        retries left, then left out by the trainer. Never scored: its 0 is a placeholder."""
        self._collect(error_sample(-1, request, f"the engine refused the request: {error}"), 0.0)

    def _collect_scored(self, view: Sample, score: float) -> None:
        """A service result: back to its sample, with the episode's score (``EpisodeScorer``
        when the run has environments: failures 0, per-turn rewards added)."""
        sample = self._views.pop(id(view), view)
        # float64 carries the service's float exactly (the plain worker's finish is the identity)
        score = float(self.reward.finish([sample], torch.tensor([score], dtype=torch.float64))[0])
        self._collect(sample, score)

    def _retry(self, sample: Sample) -> bool:
        """Generate an infrastructure-failed sample again (its group's request k, same seed;
        an episode gets a fresh environment) while it has retries left."""
        g, k = sample.group_id, int(sample.metadata.get("sample_index", 0))
        if g is None or infra_cause(sample) is None:
            return False
        done = self._attempts.get((g, k), 0)
        if done >= self.cfg.failures.retries:
            return False
        self._attempts[(g, k)] = done + 1
        b = self.cfg.algo.prompts_per_step
        step, index = divmod(g, b)
        prompt = self._prompts_for_step(step)[index]
        request = group_requests(prompt, self.cfg, step, index, g, self.stop_ids)[k]
        self.engine.submit_many([request])
        self.samples_retried += 1
        return True

    def _collect(self, sample: Sample, score: float) -> None:
        self._last_progress = time.monotonic()
        if self._retry(sample):
            return
        g = int(sample.group_id) if sample.group_id is not None else -1
        group = self._pending.setdefault(g, [])
        group.append((sample, score))
        if len(group) == self.cfg.algo.group_size:
            del self._pending[g]
            for k in range(self.cfg.algo.group_size):
                self._attempts.pop((g, k), None)
            self.groups_completed += 1
            if self._regenerate_small(g, group) or self._drop_without_signal(g, group):
                return
            group.sort(key=lambda x: x[0].metadata.get("sample_index", 0))
            self.buffer.put(
                ScoredGroup(
                    g,
                    [s for s, _ in group],
                    torch.tensor([sc for _, sc in group], dtype=torch.float32),
                )
            )

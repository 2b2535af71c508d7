"""The Ray rollout client: rollout replicas (hosts with an engine) behind the interface of
:class:`relayrl.cluster.engine_process.EngineProcess` (``submit_many``, ``poll``, ``generate``,
``update_weights``, ``stats``, ``close``, ``version``).

Requests go to the replica with the fewest outstanding tokens; weights go through Ray's object
store (put once, every replica fetches it), or with ``collective`` (``weight_sync.transport``)
are broadcast bucket by bucket over a process group of trainer rank 0 and the replicas
(:mod:`relayrl.cluster.weight_collective`), or are copied in-process when the replica hosts the
actor itself (an FSDP2 actor: every rank of its group joins the bucketed gather, the replica
ranks load each bucket); a dead replica is restarted with the current weights and its
in-flight requests resubmitted.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError
from torch import Tensor

from relayrl.cluster.engine_process import drain_queue
from relayrl.cluster.ray_workers import TICKET, RemoteStateDict
from relayrl.rollout import EngineReport, GenerationRequest, Sample

log = logging.getLogger(__name__)


class RolloutReplicaDied(RuntimeError):
    """A rollout replica died more often than ``ray.max_replica_restarts`` allows."""


ReplicaFactory = Callable[[int, Any, int], Any]
"""(replica index, weights ObjectRef or None, version) -> a new RoleHost with an engine."""


class RayRolloutClient:
    """Rollout replicas on Ray behind the ``EngineProcess`` client interface."""

    def __init__(
        self,
        replicas: list[Any],
        colocated: list[bool],
        factory: ReplicaFactory | None,
        max_restarts: int = 3,
        version: int = 0,
        on_close: Callable[[], None] | None = None,
        min_version: Callable[[GenerationRequest], int] | None = None,
        collective: bool = False,
    ):
        self._collective = collective  # replicas joined the trainer's weight group
        self._min_version = min_version
        self._loaded_version = version  # what every replica has acknowledged loading
        self._held: list[tuple[int, GenerationRequest]] = []
        self._replicas = list(replicas)
        self._colocated = list(colocated)
        self._factory = factory
        self._max_restarts = max_restarts
        self._on_close = on_close
        self.version = version
        self._weights_ref: Any = None  # latest weights in the object store (for restarts)
        self._lock = threading.RLock()
        self._tickets = itertools.count()
        self._inflight: list[dict[int, GenerationRequest]] = [{} for _ in replicas]
        self._outstanding = [0] * len(replicas)
        self._eval_tickets: set[int] = set()
        self._eval: dict[int, Sample] = {}
        self._eval_cv = threading.Condition(self._lock)
        self._samples: queue.Queue[Sample] = queue.Queue()
        self._error: BaseException | None = None
        self._stopping = False
        self.restarts = 0
        self.resubmitted = 0
        self.duplicates_dropped = 0
        self.delivered = 0
        self.last_sync_s = 0.0
        self.sync_times: list[float] = []
        self._receivers = [
            threading.Thread(target=self._receive_loop, args=(i,), daemon=True)
            for i in range(len(replicas))
        ]
        for t in self._receivers:
            t.start()

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    def replica(self, index: int) -> Any:
        """The Ray actor handle of replica ``index`` (tests kill it)."""
        return self._replicas[index]

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _cost(req: GenerationRequest) -> int:
        """Outstanding-token estimate of a request: its prompt plus its token budget."""
        return len(req.prompt_ids) + int(req.params.max_tokens)

    def _dispatch(self, tagged: list[tuple[int, GenerationRequest]]) -> None:
        """Assign each request to the replica with the fewest outstanding tokens, send.

        A request whose group needs newer weights than the replicas have (``min_version``:
        the trainer version that admitted it) is held until ``update_weights`` brings them,
        so no token of it is sampled from weights older than its admission allows.
        """
        per: dict[int, list[GenerationRequest]] = {}
        with self._lock:
            if self._min_version is not None:
                ready = []
                for item in tagged:
                    held = self._min_version(item[1]) > self._loaded_version
                    (self._held if held else ready).append(item)
                tagged = ready
            for ticket, req in tagged:
                i = min(range(len(self._replicas)), key=lambda j: self._outstanding[j])
                self._inflight[i][ticket] = req
                self._outstanding[i] += self._cost(req)
                per.setdefault(i, []).append(req)
            handles = {i: self._replicas[i] for i in per}
        for i, reqs in per.items():
            handles[i].rollout_submit.remote(reqs)  # a dead replica is caught by its receiver

    def _receive_loop(self, index: int) -> None:
        while not self._stopping:
            handle = self._replicas[index]
            try:
                samples = ray.get(handle.rollout_poll.remote(0.2))
            except RayActorError as exc:
                if self._stopping:
                    return
                try:
                    self._restart(index, exc)
                except BaseException as err:  # surfaced by the next client call
                    self._error = err
                    with self._eval_cv:
                        self._eval_cv.notify_all()
                    return
                continue
            for s in samples:
                self._deliver(index, s)

    def _deliver(self, index: int, sample: Sample) -> None:
        ticket = sample.metadata.pop(TICKET, None)
        with self._lock:
            req = self._inflight[index].pop(ticket, None) if ticket is not None else None
            if req is None:  # not in flight there any more: a duplicate, drop it
                self.duplicates_dropped += 1
                return
            self._outstanding[index] -= self._cost(req)
            self.delivered += 1
            if ticket in self._eval_tickets:
                self._eval_tickets.discard(ticket)
                self._eval[ticket] = sample
                self._eval_cv.notify_all()
                return
        self._samples.put(sample)

    def _restart(self, index: int, cause: BaseException) -> None:
        """Replace a dead replica and resubmit what was in flight on it."""
        if self._collective:
            raise RolloutReplicaDied(
                f"rollout replica {index} died and cannot be restarted under "
                "weight_sync.transport=collective (the weight group cannot be re-formed "
                f"mid-run; object_store restarts replicas): {cause}"
            )
        if self._colocated[index] or self._factory is None:
            raise RolloutReplicaDied(
                f"rollout replica {index} died and cannot be restarted "
                f"(it is colocated with the trainer): {cause}"
            )
        if self.restarts >= self._max_restarts:
            raise RolloutReplicaDied(
                f"rollout replica {index} died after {self.restarts} restarts: {cause}"
            )
        self.restarts += 1
        log.warning("rollout replica %d died (%s); restarting", index, type(cause).__name__)
        with self._lock:
            lost = list(self._inflight[index].items())
            self._inflight[index] = {}
            self._outstanding[index] = 0
            handle = self._factory(index, self._weights_ref, self.version)
            self._replicas[index] = handle
        ray.get(handle.ready.remote())
        self.resubmitted += len(lost)
        self._dispatch([(t, self._retag(r, t)) for t, r in lost])

    @staticmethod
    def _retag(req: GenerationRequest, ticket: int) -> GenerationRequest:
        return GenerationRequest(
            req.prompt_ids, req.params, req.group_id, {**req.metadata, TICKET: ticket}
        )

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ interface
    def submit_many(self, requests: Iterable[GenerationRequest]) -> None:
        self._check()
        tagged = []
        for r in requests:
            t = next(self._tickets)
            tagged.append((t, self._retag(r, t)))
        self._dispatch(tagged)

    def submit(self, request: GenerationRequest) -> None:
        self.submit_many([request])

    def prioritize(self, group_ids: Iterable[int]) -> None:
        """Every replica makes these groups' rows urgent (``RolloutEngine.prioritize``)."""
        self._check()
        ids = list(group_ids)
        with self._lock:
            handles = list(self._replicas)
        for h in handles:
            h.rollout_prioritize.remote(ids)  # a dead replica is caught by its receiver

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Finished samples so far (waits up to ``timeout`` seconds for the first one)."""
        self._check()
        out = drain_queue(self._samples, timeout)
        if not out:
            self._check()
        return out

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Blocking: complete ``requests`` (alongside anything else in flight), in order."""
        self._check()
        tickets = [next(self._tickets) for _ in requests]
        with self._lock:
            self._eval_tickets.update(tickets)
        self._dispatch([(t, self._retag(r, t)) for t, r in zip(tickets, requests, strict=True)])
        with self._eval_cv:
            while not all(t in self._eval for t in tickets):
                self._check()
                self._eval_cv.wait(timeout=0.5)
            return [self._eval.pop(t) for t in tickets]

    def update_weights(
        self, state_dict: Mapping[str, Tensor], version: int, interrupt: bool = True
    ) -> None:
        """Push weights as ``version`` to every replica and wait until all have loaded them.

        A replica colocated with the actor copies them in-process; others fetch the one copy
        put in the object store, or (``collective``) receive the broadcast of the weight
        group, bucket by bucket. Timed: ``last_sync_s`` / ``stats()["weight_sync_s"]``.
        """
        self._check()
        t0 = time.perf_counter()
        remote = isinstance(state_dict, RemoteStateDict)
        if remote and self._collective:
            self._update_collective(state_dict, version, interrupt)
            self._finish_update(version, t0)
            return
        need_ref = not remote or not all(self._colocated)
        ref = None
        if need_ref:
            if isinstance(state_dict, RemoteStateDict):
                ref = state_dict.ref  # sharded: every trainer rank joins the gather
            else:
                ref = ray.put({k: v.detach() for k, v in state_dict.items()})
        with self._lock:
            self._weights_ref = ref if ref is not None else self._weights_ref
            calls = []
            for i, h in enumerate(self._replicas):
                local = remote and self._colocated[i]
                calls.append(h.rollout_update.remote(None if local else ref, version, interrupt))
            if remote and state_dict.sharded and not need_ref:
                # FSDP2 actor colocated: its ranks without an engine join the gather
                mine = {h._actor_id for h in self._replicas}
                for h in state_dict.group.hosts:
                    if h._actor_id not in mine:
                        calls.append(h.rollout_update.remote(None, version, interrupt))
            self.version = version
        for c in calls:
            try:
                ray.get(c)
            except RayActorError:  # it is restarted by its receiver with these weights
                pass
        self._finish_update(version, t0)

    def _update_collective(self, state: RemoteStateDict, version: int, interrupt: bool) -> None:
        """One broadcast over the weight group: every trainer rank of an FSDP2 actor (the
        gathers), rank 0 alone otherwise, and every replica at once."""
        trainers = state.group.hosts if state.sharded else state.group.hosts[:1]
        with self._lock:
            calls = [h.weights_send.remote(version) for h in trainers]
            calls += [h.weights_receive.remote(interrupt) for h in self._replicas]
            self.version = version
        ray.get(calls)  # a dead member fails the sync (no restart under this transport)

    def _finish_update(self, version: int, t0: float) -> None:
        with self._lock:
            self._loaded_version = version
            held, self._held = self._held, []
        if held:
            self._dispatch(held)
        self.last_sync_s = time.perf_counter() - t0
        self.sync_times.append(self.last_sync_s)

    def report(self) -> EngineReport:
        """Merged engine counters of all replicas and their busy spans since the last report."""
        self._check()
        with self._lock:
            handles = list(self._replicas)
        results = []
        for h in handles:
            try:
                results.append(ray.get(h.rollout_stats.remote()))
            except RayActorError:
                continue
        merged: dict[str, Any] = {}
        spans: list[tuple[float, float]] = []
        for st, sp in results:
            spans.extend(sp)
            for k, v in st.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    merged[k] = merged.get(k, 0) + v
        n = max(len(results), 1)
        if results:
            merged["mean_slot_utilisation"] = merged.get("mean_slot_utilisation", 0.0) / n
            merged["version"] = min(st["version"] for st, _ in results)
        merged.setdefault("tokens_per_s", 0.0)
        merged.setdefault("mean_slot_utilisation", 0.0)
        merged["replicas"] = len(handles)
        merged["replica_restarts"] = self.restarts
        merged["requests_resubmitted"] = self.resubmitted
        merged["duplicates_dropped"] = self.duplicates_dropped
        merged["weight_sync_s"] = self.last_sync_s
        return EngineReport(merged, spans)

    def outstanding_tokens(self) -> list[int]:
        """Per replica: the token estimate of its in-flight requests (the balancing key)."""
        with self._lock:
            return list(self._outstanding)

    def in_flight(self) -> int:
        """Requests sent to a replica (or held for newer weights) and not yet delivered."""
        with self._lock:
            return sum(len(d) for d in self._inflight) + len(self._held)

    def close(self) -> None:
        """Stop the receivers, then the replicas and pools (``on_close``)."""
        self._stopping = True
        for t in self._receivers:
            t.join(timeout=2)
        if self._on_close is not None:
            self._on_close()

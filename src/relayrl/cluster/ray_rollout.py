"""The Ray rollout client: rollout replicas (hosts with an engine) behind the interface of
:class:`relayrl.cluster.engine_process.EngineProcess` (``submit_many``, ``poll``, ``generate``,
``update_weights``, ``stats``, ``close``, ``version``).

Requests go to the replica with the fewest outstanding tokens; weights go through Ray's object
store (put once, every replica fetches it), or with ``collective`` (``weight_sync.transport``)
are broadcast bucket by bucket over a process group of trainer rank 0 and the replicas
(:mod:`relayrl.cluster.weight_collective`), or are copied in-process when the replica hosts the
actor itself (an FSDP2 actor: every rank of its group joins the bucketed gather, the replica
ranks load each bucket); a dead replica is restarted with the current weights and its
in-flight requests resubmitted (to the live replicas at once), each tagged with the cause
``replica_lost`` (``controller.failures.note_retry``: its sample's ``metadata["retried"]``,
counted per step in ``failures/retried/replica_lost``).

``supports_top_logprobs`` (``top_logprobs=``, what ``ray_roles`` asked every replica's engine:
the built-in one and vLLM keep them): a request's alternatives come back in its sample
(``Sample.top_logprobs``, through Ray with the rest of it). There is no progress path: a
streaming reader gets the tokens and their alternatives with the sample, at the finish.

Under ``collective`` the restarted replica takes the dead one's rank in a re-formed weight
group (:class:`~relayrl.cluster.ray_weight_sync.WeightGroupMembers`: every member leaves,
all join the next generation) and gets no request until a sync over the new group has loaded
the current weights: at once when the actor's weights are still the version last sent, else
at the next ``update_weights``. Before each sync the replicas are probed through Ray; a
replica that dies during one makes the sync fail (gloo: at once; NCCL: after
``weight_sync.timeout_s``), and ``update_weights`` waits for the restart and sends again.
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

from relayrl.cluster.live_requests import drain_queue
from relayrl.cluster.ray_weight_sync import ReplicaLost, WeightGroupMembers, dead_among
from relayrl.cluster.ray_workers import TICKET, RemoteStateDict
from relayrl.controller.failures import InfraBudgetExceeded, note_retry
from relayrl.rollout import EngineReport, GenerationRequest, Sample

log = logging.getLogger(__name__)


class RolloutReplicaDied(InfraBudgetExceeded):
    """A rollout replica died more often than ``ray.max_replica_restarts`` allows (or one
    that cannot be restarted died): the run stops with one line naming the cause
    ``replica_lost`` and its last error (exit 1, the trainer appends the newest intact
    checkpoint)."""


ReplicaFactory = Callable[[int, Any, int], Any]
"""(replica index, weights ObjectRef or None, version) -> a new RoleHost with an engine."""


def lost_on_replica(
    req: GenerationRequest, ticket: int, index: int, cause: BaseException
) -> GenerationRequest:
    """A request in flight on replica ``index`` when it died, to resubmit as ``ticket``: its
    metadata tagged with the infrastructure cause ``replica_lost`` (``note_retry``)."""
    error = f"rollout replica {index} died ({type(cause).__name__}) with the request in flight"
    meta = note_retry({**req.metadata, TICKET: ticket}, "replica_lost", error)
    return GenerationRequest(req.prompt_ids, req.params, req.group_id, meta)


class RayRolloutClient:
    """Rollout replicas on Ray: a :class:`~relayrl.rollout.PollingBackend` (as
    ``EngineProcess``)."""

    def __init__(
        self,
        replicas: list[Any],
        colocated: list[bool],
        factory: ReplicaFactory | None,
        max_restarts: int = 3,
        version: int = 0,
        on_close: Callable[[], None] | None = None,
        min_version: Callable[[GenerationRequest], int] | None = None,
        members: WeightGroupMembers | None = None,
        sync_timeout_s: float = 600.0,
        top_logprobs: bool = False,
    ):
        self.supports_top_logprobs = top_logprobs  # every replica's engine keeps them
        self._sync_timeout_s = sync_timeout_s  # object store: a replica's load, at most
        self._members = members  # the weight group of trainer rank 0 and the replicas
        self._collective = members is not None
        self._sync_lock = threading.Lock()  # one sync or re-formation of the group at a time
        self._group_ok = True  # the group holds the current replicas (False: being re-formed)
        self._group_version: int | None = version  # what the current group last delivered
        self._routable = [True] * len(replicas)  # has the current weights: may get requests
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

    def replicas_ready(self) -> bool:
        """Every replica may get requests (``collective``: false while the weight group is
        re-formed or a restarted replica waits for its first sync)."""
        with self._lock:
            return self._group_ok and all(self._routable)

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
                ready: list[tuple[int, GenerationRequest]] = []
                for item in tagged:
                    held = self._min_version(item[1]) > self._loaded_version
                    (self._held if held else ready).append(item)
                tagged = ready
            live = [j for j in range(len(self._replicas)) if self._routable[j]]
            if not live:  # every replica is waiting for its first sync after a restart
                self._held.extend(tagged)
                tagged = []
            for ticket, req in tagged:
                i = min(live, key=lambda j: self._outstanding[j])
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
        """Replace a dead replica and resubmit what was in flight on it (to the live replicas;
        ``collective``: then re-form the weight group with the new one)."""
        error = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        if self._colocated[index] or self._factory is None:
            raise RolloutReplicaDied(
                f"rollout replica {index} died and cannot be restarted (it is colocated with "
                f"the trainer): infrastructure failure replica_lost; last error: {error}"
            )
        if self.restarts >= self._max_restarts:
            raise RolloutReplicaDied(
                f"rollout replica {index} died after {self.restarts} restarts "
                f"(ray.max_replica_restarts={self._max_restarts}): infrastructure failures, "
                f"mostly replica_lost ({self.resubmitted} requests resubmitted); "
                f"last error: {error}"
            )
        self.restarts += 1
        log.warning("rollout replica %d died (%s); restarting", index, type(cause).__name__)
        with self._lock:
            lost = list(self._inflight[index].items())
            self._inflight[index] = {}
            self._outstanding[index] = 0
            if self._collective:
                # its weights come over the re-formed group; version -1: any sync loads
                self._group_ok = False
                self._routable[index] = False
                handle = self._factory(index, None, -1)
            else:
                handle = self._factory(index, self._weights_ref, self.version)
            self._replicas[index] = handle
        resubmit = [(t, lost_on_replica(r, t, index, cause)) for t, r in lost]
        self.resubmitted += len(lost)
        if self._collective:  # the live replicas take them now, the new one after its sync
            self._dispatch(resubmit)
            ray.get(handle.ready.remote())
            self._reform()
            return
        ray.get(handle.ready.remote())
        self._dispatch(resubmit)

    def _reform(self) -> None:
        """Form the weight group again with the current replicas, then (if the actor's
        weights are still the version last sent) a full sync, after which every replica may
        get requests. A replica dead meanwhile: its own restart re-forms the group."""
        assert self._members is not None
        with self._sync_lock:
            handles = list(self._replicas)
            if dead_among(handles):
                return
            try:
                self._members.form(handles)
                version = self._members.sync_current(handles)
            except ReplicaLost:
                return
            with self._lock:
                self._group_ok = True
                self._group_version = version
                if version is not None:
                    self._routable = [True] * len(handles)
                self._eval_cv.notify_all()
        if version is not None:
            log.info(
                "weight group generation %d: every replica at version %d",
                self._members.generation,
                version,
            )
            self._release_held()

    @staticmethod
    def _retag(req: GenerationRequest, ticket: int) -> GenerationRequest:
        return GenerationRequest(
            req.prompt_ids, req.params, req.group_id, {**req.metadata, TICKET: ticket}
        )

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ interface
    @property
    def max_slots(self) -> int | None:
        """None: a pool of replicas (the controller uses ``rollout.max_slots``)."""
        return None

    @property
    def max_model_len(self) -> int | None:
        """None: the replicas' engines read it from the model."""
        return None

    def rejected(self) -> list[tuple[GenerationRequest, str]]:
        """Nothing: a replica hands a request it cannot run back as an ``'abort'`` sample."""
        return []

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
        remote = state_dict if isinstance(state_dict, RemoteStateDict) else None
        if remote is not None and self._collective:
            self._update_collective(remote, version, interrupt)
            self._finish_update(version, t0)
            return
        need_ref = remote is None or not all(self._colocated)
        ref = None
        if need_ref:
            if remote is not None:
                ref = remote.ref  # sharded: every trainer rank joins the gather
            else:
                ref = ray.put({k: v.detach() for k, v in state_dict.items()})
        with self._lock:
            self._weights_ref = ref if ref is not None else self._weights_ref
            calls = []
            for i, h in enumerate(self._replicas):
                local = remote is not None and self._colocated[i]
                calls.append(h.rollout_update.remote(None if local else ref, version, interrupt))
            if remote is not None and remote.sharded and not need_ref:
                # FSDP2 actor colocated: its ranks without an engine join the gather
                mine = {h._actor_id for h in self._replicas}
                for h in remote.group.hosts:
                    if h._actor_id not in mine:
                        calls.append(h.rollout_update.remote(None, version, interrupt))
            self.version = version
            handles = list(self._replicas)
        self._wait_loaded(calls, handles, version)
        self._finish_update(version, t0)

    def _wait_loaded(self, calls: list[Any], handles: list[Any], version: int) -> None:
        """Wait for every replica's ``rollout_update`` (``calls[i]``: replica i; any further
        ones: trainer ranks joining a gather), at most ``weight_sync.timeout_s``. A dead
        replica is restarted by its receiver with these weights; one that did not answer in
        time is alive but stuck (stopped, deadlocked): named with the version in a warning
        and killed, so that its receiver restarts it with these weights the same way."""
        ready, pending = ray.wait(calls, num_returns=len(calls), timeout=self._sync_timeout_s)
        for c in ready:
            try:
                ray.get(c)
            except RayActorError:  # it is restarted by its receiver with these weights
                pass
        stuck = [i for i, c in enumerate(calls[: len(handles)]) if c in pending]
        if len(stuck) < len(pending):  # a trainer rank: not a replica to restart
            raise RuntimeError(
                f"weight sync of version {version}: a trainer rank did not finish its part "
                f"within weight_sync.timeout_s={self._sync_timeout_s:g} s"
            )
        for i in stuck:
            log.warning(
                "weight sync of version %d: rollout replica %d did not load it within "
                "weight_sync.timeout_s=%g s; killing it for a restart",
                version,
                i,
                self._sync_timeout_s,
            )
            ray.kill(handles[i], no_restart=True)

    def _update_collective(self, state: RemoteStateDict, version: int, interrupt: bool) -> None:
        """One broadcast over the weight group: every trainer rank of an FSDP2 actor (the
        gathers), rank 0 alone otherwise, and every replica at once. The replicas are probed
        through Ray first; if one is dead (or dies during the broadcast), wait for its
        restart and the re-formed group, then send again (a re-formation that already
        delivered ``version`` ends it)."""
        assert self._members is not None
        with self._lock:
            self.version = version
        failed = False
        while True:
            with self._eval_cv:
                while not self._group_ok:
                    self._check()
                    self._eval_cv.wait(timeout=0.5)
            with self._sync_lock:
                if not self._group_ok:
                    continue
                if failed and self._group_version == version:
                    break  # the re-formation's full sync delivered this version
                handles = list(self._replicas)
                try:
                    if dead_among(handles, what=f"weight sync of version {version}"):
                        raise ReplicaLost([])
                    self._members.sync(handles, version, interrupt)
                except ReplicaLost:
                    failed = True
                    with self._lock:
                        if self._replicas == handles:  # not re-formed yet: wait for it
                            self._group_ok = False
                    continue
                self._group_version = version
                break
        with self._lock:
            self._routable = [True] * len(self._replicas)

    def _release_held(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        if held:
            self._dispatch(held)

    def _finish_update(self, version: int, t0: float) -> None:
        with self._lock:
            self._loaded_version = version
        self._release_held()
        self.last_sync_s = time.perf_counter() - t0
        self.sync_times.append(self.last_sync_s)

    def report(self) -> EngineReport:
        """Merged engine counters of all replicas and their busy spans since the last report."""
        self._check()
        with self._lock:
            handles = list(self._replicas)
            routable = list(self._routable)
        results = []
        for h, ok in zip(handles, routable, strict=True):
            try:
                st, sp = ray.get(h.rollout_stats.remote())
            except RayActorError:
                continue
            if not ok:  # restarted, not yet synced: its version is not the pool's
                st = {k: v for k, v in st.items() if k != "version"}
            results.append((st, sp))
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
            versions = [st["version"] for st, _ in results if "version" in st]
            if versions:
                merged["version"] = min(versions)
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

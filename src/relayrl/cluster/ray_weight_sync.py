"""The host side of ``weight_sync.transport: collective`` (mixed into ``RoleHost``).

The trainer's rank 0 and every rollout replica join one :class:`WeightGroup`
(``weights_join``, all at once, at build time). A sync is ``weights_send(version)`` on every
rank of the actor's pool (an FSDP2 actor: every rank joins the gathers, rank 0 broadcasts
each bucket) together with ``weights_receive(interrupt)`` on every replica, which loads each
bucket into its engine as it arrives (``RolloutEngine.update_weights_streamed``: keys and
shapes checked against the manifest before anything loads, the version made current after
the last bucket). The vLLM backend takes the whole dict at once (``update_weights``: its
deferred-update contract keeps the dict), so there the buckets are assembled first.

When a replica dies the group is re-formed (:class:`WeightGroupMembers`, the controller side):
every member ``weights_leave``s, the restarted replica takes the dead one's rank and all
``weights_join`` the next generation. Its first sync is a full one: the weights of the version
trainer rank 0 last sent, if the actor has not changed since (``weights_hold``: an actor
update or checkpoint load marks the weights unsent, and holds the same lock for its duration,
so a sync never reads a half-updated model); otherwise the next ``update_weights`` sends them.
A replica whose receive failed part-way (a peer died) stops stepping its engine until a sync
completes, so it never samples from a half-loaded model.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from torch import Tensor

from relayrl.cluster.weight_collective import (
    Entry,
    WeightGroup,
    WeightSyncError,
    drain,
    entries_of,
    open_rendezvous,
    plan_buckets,
)
from relayrl.rollout import RolloutEngine, SteppingEngine

log = logging.getLogger(__name__)

STUCK_GRACE_S = 30.0
"""Seconds past ``weight_sync.timeout_s`` a replica's part of a sync may take after another
member's returned before it counts as stuck (slack for a busy host)."""

MUTATES_ACTOR = frozenset({"update", "load_train_state", "load_sharded"})
"""Actor methods after which its weights are no longer the version last sent."""


def _sync_bytes(cfg: Any) -> int:
    return int(cfg.model.fsdp.sync_bucket_mb * (1 << 20))


class CollectiveWeightSync:
    """``RoleHost`` methods of the collective transport (needs ``spec``, ``roles``,
    ``engine``, ``_cv``, ``_updates`` and ``_sharded_actor`` of the host)."""

    spec: Any
    roles: dict[str, Any]
    engine: SteppingEngine | None
    _weight_group: WeightGroup | None = None
    _weights_server: Any = None  # rank 0: the next generation's rendezvous (a TCPStore)
    _torn = False  # a receive failed part-way: the engine is paused until a sync completes
    _weights_lock: threading.Lock
    _cv: threading.Condition  # the host's: engine steps and weight loads take turns under it
    _updates: int  # weight receives waiting for ``_cv`` (they go before engine steps)
    _weights_version: int | None = 0  # the version the actor's weights are (None: changed)

    def _init_weight_sync(self) -> None:
        self._weights_lock = threading.Lock()
        self._weights_version = 0  # the actor as built: what every replica starts with

    def actor_call(self, method: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (a method of the actor); one that changes its weights holds the weights
        lock (no sync reads them meanwhile) and marks them unsent."""
        if method not in MUTATES_ACTOR:
            return fn(*args, **kwargs)
        with self._weights_lock:
            self._weights_version = None
            return fn(*args, **kwargs)

    def weights_backend(self) -> str:
        """gloo or nccl for the weight group (``weight_sync.backend``; ``auto``: NCCL when
        this (trainer rank 0) process computes on CUDA and the rollout pool has GPUs)."""
        from relayrl.cluster.placement_check import weight_backend
        from relayrl.model.device import resolve_device

        device = resolve_device(self.spec.cfg.model.device, self.spec.rank)
        return weight_backend(self.spec.cfg, device.type == "cuda")

    def weights_open_rendezvous(self, world: int) -> tuple[str, int]:
        """Trainer rank 0: open the next generation's rendezvous (``open_rendezvous``, held
        until ``weights_join``); returns this node's IP and its port."""
        ip = ray.util.get_node_ip_address()
        self._weights_server = open_rendezvous(ip, world, self.spec.cfg.weight_sync.timeout_s)
        return ip, int(self._weights_server.port)

    def weights_join(
        self, addr: str, port: int, rank: int, world: int, backend: str, generation: int = 0
    ) -> None:
        """Join generation ``generation`` of the weight group (every member at once: the
        rendezvous waits for all), leaving an older one first."""
        self.weights_leave()
        server, self._weights_server = self._weights_server, None
        self._weight_group = WeightGroup(
            addr,
            port,
            rank,
            world,
            backend,
            self.spec.cfg.weight_sync.timeout_s,
            generation,
            server if rank == 0 else None,
        )

    def weights_leave(self) -> None:
        """Leave the weight group (a member died: the group is formed again)."""
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.close()

    def weights_hold(self) -> int | None:
        """Trainer side of a restart's full sync: the version the actor's weights are, with
        the weights lock held until ``weights_release`` (an actor update waits meanwhile), or
        None (lock not taken) while an update runs or since one ran (the next
        ``update_weights`` sends them)."""
        if not self._weights_lock.acquire(blocking=False):
            return None
        if self._weights_version is None:
            self._weights_lock.release()
            return None
        return self._weights_version

    def weights_release(self) -> None:
        self._weights_lock.release()

    def weights_send(self, version: int, held: bool = False) -> float:
        """One sync from the actor (seconds): its weights ARE ``version`` (the caller's
        contract). Under FSDP2 every rank of the pool calls it (the gathers are collectives of
        the trainer group); only the weight group's rank 0 sends. ``held``: the weights lock
        is already held (``weights_hold``)."""
        if not held:
            self._weights_lock.acquire()
        try:
            self._weights_version = version
            return self._send(version)
        finally:
            if not held:
                self._weights_lock.release()

    def _send(self, version: int) -> float:
        t0 = time.perf_counter()
        actor = self.roles["actor"]
        group = self._weight_group
        bucket_bytes = _sync_bytes(self.spec.cfg)
        if getattr(actor, "sharded", False):
            from relayrl.workers.fsdp import iter_full_tensors

            to_cpu = group is None or group.backend == "gloo"
            tensors = iter_full_tensors(actor.model, to_cpu=to_cpu)
            if group is None:  # another rank of the FSDP group: join the gathers only
                for _ in tensors:
                    pass
                return time.perf_counter() - t0
            from relayrl.workers.fsdp import engine_entries

            entries = [
                Entry(k, shape, dt) for k, (shape, dt) in engine_entries(actor.model).items()
            ]
        else:
            if group is None:
                raise RuntimeError("weights_send: this process is not in the weight group")
            state: dict[str, Tensor] = actor.state_dict()  # LoRA: merged
            entries = entries_of(state)
            tensors = iter(state.items())
        try:
            group.send(version, plan_buckets(entries, bucket_bytes), tensors)
        except BaseException:
            for _ in tensors:  # FSDP2: the other ranks' gathers still need this rank
                pass
            raise
        return time.perf_counter() - t0

    def weights_receive(self, interrupt: bool) -> float:
        """One sync into this replica's engine (seconds)."""
        t0 = time.perf_counter()
        group = self._weight_group
        if group is None or self.engine is None:
            raise RuntimeError("weights_receive: this replica is not in the weight group")
        engine = self.engine
        version, buckets, parts = group.receive()  # a failure here has loaded nothing
        self._updates += 1
        ok = False
        try:
            with self._cv:
                if version == engine.version:
                    drain(parts)  # already loaded (the first sync of a run): join, load nothing
                elif isinstance(engine, RolloutEngine):  # the own engine: part by part
                    shapes = {e.name: e.shape for b in buckets for e in b}
                    try:
                        engine.update_weights_streamed(parts, version, shapes, interrupt)
                    finally:
                        drain(parts)
                else:  # vLLM: one dict
                    state: dict[str, Tensor] = {}
                    for part in parts:
                        state.update(part)
                    engine.update_weights(state, version, interrupt=interrupt)
            ok = True
        finally:
            with self._cv:
                # A failed receive may have loaded part of the weights: the engine loop
                # stays paused (``_torn``) until a sync completes.
                self._torn = not ok
                self._updates -= 1
                self._cv.notify_all()
        return time.perf_counter() - t0

    def engine_state(self) -> dict[str, Tensor]:
        """A copy of the engine's weights and its version (tests)."""
        assert self.engine is not None
        with self._cv:
            if not isinstance(self.engine, RolloutEngine):
                raise RuntimeError("engine_state: this engine exposes no model")
            model = self.engine.model
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            state["__version__"] = torch.tensor(self.engine.version)
            return state


class ReplicaLost(RuntimeError):
    """A member of the weight group died (``dead``: replica indices): the group must be
    formed again."""

    def __init__(self, dead: list[int], cause: BaseException | None = None):
        super().__init__(f"weight group: replica(s) {dead} died ({cause!r})")
        self.dead = dead


def dead_among(handles: list[Any], timeout_s: float = 30.0, what: str = "a probe") -> list[int]:
    """Indices of the Ray actors among ``handles`` that are dead (a cheap call to each), or
    stuck: alive for Ray but no answer within ``timeout_s`` (a stopped or deadlocked
    process). A stuck one is killed, so that the rollout client restarts it
    (``ray.max_replica_restarts``), with a warning naming it and ``what`` (the sync and its
    version)."""
    refs = [h.ready.remote() for h in handles]
    dead = []
    deadline = time.monotonic() + timeout_s
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except RayActorError:
            dead.append(i)
        except GetTimeoutError:
            log.warning(
                "%s: replica %d did not answer a probe within %g s; killing it for a restart",
                what,
                i,
                timeout_s,
            )
            ray.kill(handles[i], no_restart=True)
            dead.append(i)
    return dead


class WeightGroupMembers:
    """The controller side of the collective transport: forms the weight group of trainer
    rank 0 (rank 0) and the replicas (ranks 1..R), one generation at a time, and runs a
    sync over it.

    ``trainers``: the actor's hosts (an FSDP2 actor: every rank joins the gathers of a sync;
    otherwise rank 0 alone sends).
    """

    def __init__(self, trainers: list[Any], sharded: bool, timeout_s: float):
        self.trainers = list(trainers) if sharded else list(trainers[:1])
        self.timeout_s = timeout_s
        self.generation = -1
        self._backend: str | None = None

    def form(self, replicas: list[Any]) -> None:
        """Every member leaves its group and joins the next generation (same world size and
        ranks; a fresh rendezvous port)."""
        head = self.trainers[0]
        if self._backend is None:
            self._backend = str(ray.get(head.weights_backend.remote()))
        members = [head, *replicas]
        for ref in [h.weights_leave.remote() for h in members]:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except RayActorError:
                pass  # a dead member: the caller sees it at the join
        self.generation += 1
        world = len(members)
        addr, port = ray.get(head.weights_open_rendezvous.remote(world))
        refs = [
            h.weights_join.remote(addr, port, r, world, self._backend, self.generation)
            for r, h in enumerate(members)
        ]
        self._collect(
            replicas, refs[1:], refs[:1], f"forming weight group generation {self.generation}"
        )

    def sync(self, replicas: list[Any], version: int, interrupt: bool, held: bool = False) -> None:
        """One broadcast of the actor's weights as ``version`` to every replica (the actor's
        weights must be ``version``). Raises :class:`ReplicaLost` if a replica died."""
        refs = [h.weights_send.remote(version, held) for h in self.trainers]
        receives = [h.weights_receive.remote(interrupt) for h in replicas]
        self._collect(replicas, receives, refs, f"weight sync of version {version}")

    def sync_current(self, replicas: list[Any]) -> int | None:
        """A full sync of the version the actor's weights are now (after a re-formation), or
        None without a sync when they changed since the last one (every trainer rank is
        asked; the next ``update_weights`` sends them)."""
        holds = ray.get([h.weights_hold.remote() for h in self.trainers])
        held = [h for h, v in zip(self.trainers, holds, strict=True) if v is not None]
        try:
            if len(held) < len(self.trainers) or len(set(holds)) != 1:
                return None
            version = int(holds[0])
            self.sync(replicas, version, interrupt=False, held=True)
            return version
        finally:
            ray.get([h.weights_release.remote() for h in held])

    def _stuck(
        self, replicas: list[Any], replica_refs: list[Any], refs: list[Any], what: str
    ) -> None:
        """Wait for every call of a sync or rendezvous, bounded: once one has returned (the
        sender's, within ``timeout_s`` per broadcast, the group's own bound), the others get
        ``timeout_s + STUCK_GRACE_S`` more. A replica whose call has not returned by then is
        alive but stuck (stopped, deadlocked; a dead one's call fails at once): it is killed,
        so that the client restarts it (``ray.max_replica_restarts``), and the sync fails
        with :class:`ReplicaLost` whose cause names the replica and the version."""
        _, pending = ray.wait(list(refs), num_returns=1, timeout=None)
        if pending:
            grace = self.timeout_s + STUCK_GRACE_S
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=grace)
        if not pending:
            return
        stuck = [i for i, ref in enumerate(replica_refs) if ref in pending]
        if not stuck:  # a trainer rank stuck past its own bound: not a replica to restart
            raise WeightSyncError(
                f"{what}: trainer rank 0 did not return within weight_sync.timeout_s="
                f"{self.timeout_s:g} s (+{STUCK_GRACE_S:g} s) after the replicas"
            )
        for i in stuck:
            log.warning(
                "%s: replica %d did not return within weight_sync.timeout_s=%g s (+%g s) "
                "after another member; killing it for a restart",
                what,
                i,
                self.timeout_s,
                STUCK_GRACE_S,
            )
            ray.kill(replicas[i], no_restart=True)
        raise ReplicaLost(stuck, WeightSyncError(f"{what}: replica(s) {stuck} stuck"))

    def _collect(
        self, replicas: list[Any], replica_refs: list[Any], trainer_refs: list[Any], what: str
    ) -> None:
        """Wait for every call (bounded: :meth:`_stuck`); a dead replica -> ReplicaLost, a
        dead trainer -> its error; another failure with no dead replica (probed through Ray)
        is raised as it is."""
        self._stuck(replicas, replica_refs, [*replica_refs, *trainer_refs], what)
        dead: list[int] = []
        errors: list[Exception] = []
        for i, ref in enumerate(replica_refs):
            try:
                ray.get(ref)
            except RayActorError as exc:
                dead.append(i)
                errors.append(exc)
            except Exception as exc:  # noqa: BLE001 - classified below
                errors.append(exc)
        trainer_error = None
        for ref in trainer_refs:
            try:
                ray.get(ref)
            except RayActorError:
                raise  # the trainer died: the run stops
            except Exception as exc:  # noqa: BLE001 - classified below
                trainer_error = exc
        if trainer_error is not None:  # the sender's own error first: it names the cause
            errors.insert(0, trainer_error)
        if errors and not dead:
            dead = dead_among(replicas)  # it may have died after its own part completed
        if errors and not dead:
            raise errors[0]
        if dead:
            raise ReplicaLost(dead, errors[0])

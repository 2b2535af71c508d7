"""Worker groups of Ray actors, their dispatch modes, and the Ray rollout client.

One Ray actor class, :class:`RoleHost`, is the worker process of a resource pool: it hosts
every role placed on that pool (actor, reference, critic, rollout engine), so colocated roles
share the process and time-share its devices. A :class:`WorkerGroup` is the ranks of a pool;
a :class:`RemoteRole` is one role on a group, with the interface of the local worker
(``ActorWorker`` / ``ReferenceWorker`` / ``CriticWorker``): each method has a dispatch mode
(broadcast, split-by-DP-rank-and-gather, rank zero) and the controller never sees which.

:class:`RayRolloutClient` drives rollout replicas (hosts with an engine) through the same
interface as :class:`relayrl.cluster.engine_process.EngineProcess` (``submit_many``, ``poll``,
``generate``, ``update_weights``, ``stats``, ``close``, ``version``): requests go to the
replica with the fewest outstanding tokens; weights go through Ray's object store (put once,
every replica fetches it), or are copied in-process when the replica hosts the actor itself;
a dead replica is restarted with the current weights and its in-flight requests resubmitted.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from torch import Tensor

from relayrl.cluster.engine_process import drain_queue
from relayrl.config import RunConfig
from relayrl.rollout import EngineReport, GenerationRequest, RolloutEngine, Sample
from relayrl.rollout.engine import _error_sample
from relayrl.workers.experience import Experience

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
TICKET = "_ray_ticket"

BROADCAST = "broadcast"
"""Call every rank with the same arguments; return rank 0's result."""
DP_SPLIT = "dp_split"
"""Split the Experience by data-parallel rank, call each rank on its shard, gather."""
RANK_ZERO = "rank_zero"
"""Call rank 0 only (all ranks hold the same replica of the state)."""

DISPATCH: dict[str, str] = {
    "compute_logprobs": DP_SPLIT,
    "compute_values": DP_SPLIT,
    "update": DP_SPLIT,
    "state_dict": RANK_ZERO,
    "train_state": RANK_ZERO,
    "load_train_state": BROADCAST,
}


# --------------------------------------------------------------------------- host process
@dataclass
class HostSpec:
    """What one worker process of a pool builds."""

    cfg: RunConfig
    actor_path: str
    critic_path: str | None
    roles: tuple[str, ...]
    rank: int = 0
    world: int = 1
    version: int = 0
    threads: int = 1


class RoleHost:
    """One worker process of a resource pool, hosting the roles placed on the pool.

    Run as a threaded Ray actor (``max_concurrency`` > 1): the rollout engine, if any, steps
    in a background thread while other calls (submit, poll, train) come in.
    """

    def __init__(self, spec: HostSpec, weights: Mapping[str, Tensor] | None = None):
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        torch.set_num_threads(spec.threads)
        from relayrl.model import load_causal_lm, load_critic, load_tokenizer
        from relayrl.workers import ActorWorker, CriticWorker, ReferenceWorker
        from relayrl.workers.data_parallel import (
            DataParallelActorWorker,
            DataParallelCriticWorker,
        )

        cfg = spec.cfg
        self.spec = spec
        dtype = DTYPES[cfg.model.dtype]
        self.roles: dict[str, Any] = {}
        if "actor" in spec.roles:
            cls = DataParallelActorWorker if spec.world > 1 else ActorWorker
            self.roles["actor"] = cls.from_config(load_causal_lm(spec.actor_path, dtype), cfg)
        if "reference" in spec.roles:
            self.roles["reference"] = ReferenceWorker.from_config(
                load_causal_lm(cfg.model.path, dtype), cfg
            )
        if "critic" in spec.roles:
            critic_cls = DataParallelCriticWorker if spec.world > 1 else CriticWorker
            self.roles["critic"] = critic_cls(
                load_critic(spec.critic_path or cfg.model.path, dtype),
                cfg.algo,
                cfg.optim,
                cfg.seed,
            )
        self.engine: Any = None  # RolloutEngine | VllmEngine: the rollout interface
        if "rollout" in spec.roles and cfg.rollout.backend == "vllm":
            from relayrl.rollout.vllm_backend import VllmEngine

            tok = load_tokenizer(cfg.model.path)
            source = self.roles["actor"].model if "actor" in self.roles else None
            self.engine = VllmEngine(
                spec.actor_path,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                max_slots=cfg.rollout.max_slots,
                version=spec.version,
                interrupt_mode=cfg.rollout.vllm_interrupt,
                kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
                dtype=cfg.model.dtype,
                seed=cfg.seed,
                state_dict=source.state_dict()
                if source is not None
                else (dict(weights) if weights is not None else None),
            )
        elif "rollout" in spec.roles:
            if "actor" in self.roles:  # colocated: a copy of the actor's weights
                model = copy.deepcopy(self.roles["actor"].model)
            else:
                model = load_causal_lm(spec.actor_path, dtype)
                if weights is not None:
                    with torch.no_grad():
                        model.load_state_dict(dict(weights))
            tok = load_tokenizer(cfg.model.path)
            self.engine = RolloutEngine(
                model.eval().requires_grad_(False),
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                max_slots=cfg.rollout.max_slots,
                version=spec.version,
                urgent_steps=cfg.async_.urgent_steps,
            )
        if self.engine is not None:
            self._cv = threading.Condition()
            self._finished: list[Sample] = []
            self._spans: list[tuple[float, float]] = []
            self._stop = False
            self._updates = 0  # weight updates waiting for the lock: they go before steps
            self._loop = threading.Thread(target=self._engine_loop, daemon=True)
            self._loop.start()

    # ------------------------------------------------------------------ generic
    def ready(self) -> dict[str, Any]:
        """Where this process runs (node id, pid) and what it hosts."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "roles": sorted(self.roles) + (["rollout"] if self.engine is not None else []),
        }

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.method(*args)`` in this process."""
        return getattr(self.roles[role], method)(*args, **kwargs)

    def gradients(self, role: str) -> dict[str, Tensor]:
        """The current ``.grad`` of each trainable parameter of ``role`` (tests, debugging)."""
        model = self.roles[role].model
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    def free_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0 hosts the process-group rendezvous)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, int(s.getsockname()[1])

    def init_process_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the gloo group of this pool (GPU pools would use NCCL: designed, not run)."""
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world
        )

    # ------------------------------------------------------------------ rollout engine
    def _engine_loop(self) -> None:
        assert self.engine is not None
        busy_since: float | None = None
        while True:
            with self._cv:
                while not self._stop and (self._updates or not self.engine.has_unfinished()):
                    if busy_since is not None:
                        self._spans.append((busy_since, time.perf_counter()))
                        busy_since = None
                    self._cv.wait(0.5)
                if self._stop:
                    return
                busy_since = time.perf_counter() if busy_since is None else busy_since
                out = self.engine.step()
                if out:
                    self._finished.extend(out)
                    self._cv.notify_all()

    def rollout_submit(self, requests: list[GenerationRequest]) -> None:
        """Queue requests; an invalid one comes back as an error sample (never lost)."""
        assert self.engine is not None
        with self._cv:
            for r in requests:
                try:
                    self.engine.submit(r)
                except ValueError as exc:
                    self._finished.append(_error_sample(-1, r, str(exc)))
            self._cv.notify_all()

    def rollout_poll(self, timeout: float) -> list[Sample]:
        """Finished samples since the last poll (waits up to ``timeout`` for the first)."""
        with self._cv:
            if not self._finished:
                self._cv.wait(timeout)
            out, self._finished = self._finished, []
            return out

    def rollout_update(
        self, weights: Mapping[str, Tensor] | None, version: int, interrupt: bool
    ) -> float:
        """Load ``weights`` (None: this process's actor's) as ``version``; seconds it took."""
        assert self.engine is not None
        t0 = time.perf_counter()
        state = self.roles["actor"].model.state_dict() if weights is None else weights
        self._updates += 1
        try:
            with self._cv:
                if version != self.engine.version:
                    self.engine.update_weights(state, version, interrupt=interrupt)
        finally:
            with self._cv:
                self._updates -= 1
                self._cv.notify_all()
        return time.perf_counter() - t0

    def rollout_prioritize(self, group_ids: list[int]) -> None:
        assert self.engine is not None
        with self._cv:
            self.engine.prioritize(group_ids)

    def rollout_stats(self) -> tuple[dict[str, Any], list[tuple[float, float]]]:
        assert self.engine is not None
        with self._cv:
            spans, self._spans = self._spans, []
            return self.engine.stats(), spans

    def shutdown(self) -> None:
        if self.engine is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()


RoleHostActor = ray.remote(max_concurrency=16)(RoleHost)


# --------------------------------------------------------------------------- worker groups
def split_experience(exp: Experience, n: int) -> list[Experience]:
    """Contiguous near-equal shards, one per data-parallel rank."""
    if len(exp) < n:
        raise ValueError(f"a batch of {len(exp)} sequences cannot be split over {n} ranks")
    bounds = torch.arange(len(exp)).tensor_split(n)
    return [exp.select(b) for b in bounds]


SUMMED_STATS = frozenset({"actor/loss", "critic/vf_loss"})
"""Losses normalised by the global counts: the ranks' partial losses add up to the loss."""


def gather(results: list[Any]) -> Any:
    """Tensors are concatenated along the batch; stats dicts are averaged over ranks, except
    the losses (``SUMMED_STATS``), which are summed."""
    first = results[0]
    if isinstance(first, Tensor):
        return torch.cat(results)
    if isinstance(first, dict):
        out = {}
        for k in first:
            total = sum(float(r[k]) for r in results)
            out[k] = total if k in SUMMED_STATS else total / len(results)
        return out
    return first


class WorkerGroup:
    """The ranks (Ray actors) of one resource pool."""

    def __init__(self, hosts: list[Any]):
        self.hosts = hosts

    @property
    def size(self) -> int:
        return len(self.hosts)

    def call(self, role: str, method: str, mode: str, *args: Any) -> Any:
        """Call ``role.method`` under dispatch ``mode`` and return the gathered result."""
        if mode == RANK_ZERO:
            return ray.get(self.hosts[0].call.remote(role, method, *args))
        if mode == BROADCAST:
            return ray.get([h.call.remote(role, method, *args) for h in self.hosts])[0]
        if mode == DP_SPLIT:
            if self.size == 1:
                return ray.get(self.hosts[0].call.remote(role, method, *args))
            shards = split_experience(args[0], self.size)
            refs = [
                h.call.remote(role, method, s, *args[1:])
                for h, s in zip(self.hosts, shards, strict=True)
            ]
            return gather(ray.get(refs))
        raise ValueError(f"unknown dispatch mode {mode!r}")


class RemoteStateDict(Mapping[str, Tensor]):
    """A role's state dict that stays remote until someone reads it.

    A rollout replica colocated with the actor copies the weights in-process; a replica
    elsewhere gets ``.ref`` (the dict in Ray's object store, produced once by rank 0).
    """

    def __init__(self, group: WorkerGroup, role: str):
        self.group, self.role = group, role
        self._ref: Any = None
        self._value: dict[str, Tensor] | None = None

    @property
    def ref(self) -> Any:
        if self._ref is None:
            self._ref = self.group.hosts[0].call.remote(self.role, "state_dict")
        return self._ref

    def _get(self) -> dict[str, Tensor]:
        if self._value is None:
            self._value = ray.get(self.ref)
        return self._value

    def __getitem__(self, key: str) -> Tensor:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class RemoteRole:
    """A role on a worker group, with the local worker's interface.

    ``model`` is a controller-side copy refreshed from rank 0 on each access (checkpoints).
    """

    def __init__(self, group: WorkerGroup, role: str, load_shadow: Callable[[], torch.nn.Module]):
        self.group, self.role = group, role
        self._load_shadow = load_shadow
        self._shadow: torch.nn.Module | None = None

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or method not in DISPATCH:
            raise AttributeError(method)
        mode = DISPATCH[method]
        return lambda *args: self.group.call(self.role, method, mode, *args)

    def state_dict(self) -> RemoteStateDict:
        return RemoteStateDict(self.group, self.role)

    @property
    def model(self) -> torch.nn.Module:
        if self._shadow is None:
            self._shadow = self._load_shadow()
        state = ray.get(self.group.hosts[0].call.remote(self.role, "state_dict"))
        with torch.no_grad():
            self._shadow.load_state_dict(state)
        return self._shadow


# --------------------------------------------------------------------------- rollout client
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
    ):
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
        put in the object store. Timed: ``last_sync_s`` / ``stats()["weight_sync_s"]``.
        """
        self._check()
        t0 = time.perf_counter()
        remote = isinstance(state_dict, RemoteStateDict)
        need_ref = not remote or not all(self._colocated)
        ref = None
        if need_ref:
            if isinstance(state_dict, RemoteStateDict):
                ref = state_dict.ref
            else:
                ref = ray.put({k: v.detach() for k, v in state_dict.items()})
        with self._lock:
            self._weights_ref = ref if ref is not None else self._weights_ref
            calls = []
            for i, h in enumerate(self._replicas):
                local = remote and self._colocated[i]
                calls.append(h.rollout_update.remote(None if local else ref, version, interrupt))
            self.version = version
        for c in calls:
            try:
                ray.get(c)
            except RayActorError:  # it is restarted by its receiver with these weights
                pass
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

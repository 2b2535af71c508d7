"""Worker groups of Ray actors and their dispatch modes.

One Ray actor class, :class:`RoleHost`, is the worker process of a resource pool: it hosts
every role placed on that pool (actor, reference, critic, rollout engine), so colocated roles
share the process and time-share its devices. A :class:`WorkerGroup` is the ranks of a pool;
a :class:`RemoteRole` is one role on a group, with the interface of the local worker
(``ActorWorker`` / ``ReferenceWorker`` / ``CriticWorker``): each method has a dispatch mode
(broadcast, split-by-DP-rank-and-gather, rank zero) and the controller never sees which.

The roles are built by ``relayrl.workers.build`` (device, precision, checkpointing, LoRA,
FSDP2 from ``model.*``). A host of a data-parallel or FSDP2 trainer pool is constructed
empty: it joins its pool's process group first (``init_process_group``), then ``build``s,
since ``fully_shard`` needs the group. Under FSDP2 every call that gathers full weights
(``state_dict``, weight sync, the HF export) and the sharded checkpoint is a collective, so
it goes to every rank (``BROADCAST``); rank 0's result is the full state.

The rollout client over the hosts' engines is :mod:`relayrl.cluster.ray_rollout`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
from torch import Tensor

from relayrl.cluster.ray_weight_sync import CollectiveWeightSync
from relayrl.cluster.weight_collective import open_rendezvous
from relayrl.config import RunConfig
from relayrl.rollout import GenerationRequest, RolloutEngine, Sample, SteppingEngine
from relayrl.rollout.types import error_sample
from relayrl.workers.data_parallel import split_experience

RENDEZVOUS_TIMEOUT = timedelta(minutes=30)
"""How long a pool's ranks wait for each other to form the process group (torch's default)."""

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
    "save_sharded": BROADCAST,
    "load_sharded": BROADCAST,
}
SHARDED_DISPATCH = {**DISPATCH, "state_dict": BROADCAST}
"""An FSDP2 role: gathering the full weights is a collective of every rank."""


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
    grouped: bool = False
    """Joins a process group before building (``init_process_group``, then ``build``)."""
    engines_in_group: bool = False
    """Some rank of this pool hosts a rollout engine next to an FSDP2 actor: every rank joins
    the gathers that feed it."""


def _sync_bytes(cfg: RunConfig) -> int:
    return int(cfg.model.fsdp.sync_bucket_mb * (1 << 20))


def _device_rank(rank: int) -> int:
    """The index of this Ray worker's GPU among the CUDA devices it sees (``rank`` without
    CUDA): Ray's assignment, not the pool rank, which counts bundles over every node."""
    if not torch.cuda.is_available():
        return rank
    from relayrl.model.device import local_cuda_index

    return local_cuda_index(
        rank,
        torch.cuda.device_count(),
        ray.get_gpu_ids(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


class RoleHost(CollectiveWeightSync):
    """One worker process of a resource pool, hosting the roles placed on the pool.

    Run as a threaded Ray actor (``max_concurrency`` > 1): the rollout engine, if any, steps
    in a background thread while other calls (submit, poll, train) come in. The
    ``weights_*`` methods (``weight_sync.transport: collective``) are
    :class:`~relayrl.cluster.ray_weight_sync.CollectiveWeightSync`'s.
    """

    def __init__(self, spec: HostSpec, weights: Mapping[str, Tensor] | None = None):
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.cfg.seed + spec.rank)  # LoRA's initial adapters, dropout
        self.spec = spec
        self._rendezvous: Any = None  # rank 0 of a trainer pool: its TCPStore server
        self.device_rank = _device_rank(spec.rank)
        """``rank`` for ``resolve_device``: this process's local GPU (``local_cuda_index``)."""
        self.roles: dict[str, Any] = {}
        self.engine: SteppingEngine | None = None  # RolloutEngine | VllmEngine
        self._init_weight_sync()
        if not spec.grouped:
            self.build(weights)

    def build(self, weights: Mapping[str, Tensor] | None = None) -> None:
        """Build this rank's roles (after ``init_process_group`` on a grouped host: every
        rank of the pool must call at once, FSDP2 sharding and gathers are collectives)."""
        from relayrl.workers.build import build_actor, build_critic, build_reference

        spec, cfg = self.spec, self.spec.cfg
        rank, world = self.device_rank, spec.world  # the builders place on rank's device
        if "actor" in spec.roles:
            self.roles["actor"] = build_actor(cfg, spec.actor_path, rank, world)
        if "reference" in spec.roles:
            self.roles["reference"] = build_reference(cfg, self.roles.get("actor"), rank, world)
        if "critic" in spec.roles:
            path = spec.critic_path or cfg.model.path
            self.roles["critic"] = build_critic(cfg, path, rank, world)
        if "rollout" in spec.roles:
            self._build_engine(weights)
        elif self._sharded_actor() and spec.engines_in_group:
            self._gather(keep=False)  # another rank's engine is built from this gather
        if self.engine is not None:
            self._cv = threading.Condition()
            self._finished: list[Sample] = []
            self._spans: list[tuple[float, float]] = []
            self._stop = False
            self._updates = 0  # weight updates waiting for the lock: they go before steps
            self._loop = threading.Thread(target=self._engine_loop, daemon=True)
            self._loop.start()

    def _sharded_actor(self) -> bool:
        return bool(getattr(self.roles.get("actor"), "sharded", False))

    def _gather(self, keep: bool) -> dict[str, Tensor]:
        """The actor's full weights (merged under LoRA); under FSDP2 a collective of every
        rank, gathered bucket by bucket, kept only where ``keep``."""
        actor = self.roles["actor"]
        if not self._sharded_actor():
            return actor.state_dict()
        from relayrl.workers.fsdp import full_state_dict

        return full_state_dict(actor.model, _sync_bytes(self.spec.cfg), keep=keep)

    def _build_engine(self, weights: Mapping[str, Tensor] | None) -> None:
        from relayrl.model import load_causal_lm, load_tokenizer
        from relayrl.model.device import apply_precision, precision_for
        from relayrl.model.lora import is_lora
        from relayrl.rollout import RolloutEngine
        from relayrl.workers.build import engine_device

        spec, cfg = self.spec, self.spec.cfg
        tok = load_tokenizer(cfg.model.path)
        actor = self.roles.get("actor")
        lora = actor is not None and is_lora(actor.model)
        path = cfg.model.path if lora else spec.actor_path  # LoRA: merged weights on the base
        state = self._gather(keep=True) if actor is not None else weights
        if cfg.rollout.backend == "vllm":  # this process or a server (rollout.vllm_process)
            from relayrl.rollout.vllm_select import make_vllm_engine

            self.engine = make_vllm_engine(
                path,
                process=cfg.rollout.vllm_process,
                device=str(engine_device(cfg.model, self.device_rank)),
                gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                max_slots=cfg.rollout.max_slots,
                max_model_len=cfg.rollout.max_model_len,
                version=spec.version,
                interrupt_mode=cfg.rollout.vllm_interrupt,
                kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
                dtype=cfg.model.dtype,
                seed=cfg.seed,
                state_dict=dict(state) if state is not None else None,
                weight_sync_timeout_s=cfg.weight_sync.timeout_s,
            )
            return
        precision = precision_for(cfg.model, trainable=False)
        model = load_causal_lm(path, precision.param_dtype)
        if state is not None:
            with torch.no_grad():
                model.load_state_dict(dict(state))
        # this rank's device (rank r -> local CUDA device r, as its process group's)
        model = apply_precision(model, precision, engine_device(cfg.model, self.device_rank))
        self.engine = RolloutEngine(
            model.eval().requires_grad_(False),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_slots=cfg.rollout.max_slots,
            max_model_len=cfg.rollout.max_model_len,
            version=spec.version,
            urgent_steps=cfg.async_.urgent_steps,
            cuda_graphs=cfg.rollout.cuda_graphs,
        )

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
        """Run ``role.method(*args)`` in this process (``state_dict``: the full weights, see
        ``full_state``)."""
        if method == "state_dict":
            return self.full_state(role)
        fn = getattr(self.roles[role], method)
        if role == "actor":  # an update marks its weights unsent (a restart's sync waits)
            return self.actor_call(method, fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def full_state(self, role: str) -> dict[str, Tensor]:
        """The full weights of ``role`` (the engine's keys: merged under LoRA); FSDP2: a
        collective, full tensors on rank 0 and ``{}`` elsewhere."""
        worker = self.roles[role]
        if getattr(worker, "sharded", False):
            from relayrl.workers.fsdp import full_state_dict

            return full_state_dict(worker.model, _sync_bytes(self.spec.cfg))
        own = getattr(worker, "state_dict", None)
        return own() if own is not None else worker.model.state_dict()

    def model_state(self, role: str) -> dict[str, Tensor]:
        """``role``'s model state dict under its own keys (a LoRA actor: the peft model's, with
        the adapters); a sharded role: a collective, full tensors on rank 0, ``{}`` elsewhere."""
        worker = self.roles[role]
        if getattr(worker, "sharded", False):
            from relayrl.workers.fsdp import full_state_dict

            return full_state_dict(worker.model, _sync_bytes(self.spec.cfg), merged=False)
        return worker.model.state_dict()

    def gradients(self, role: str) -> dict[str, Tensor]:
        """The current ``.grad`` of each trainable parameter of ``role`` (tests, debugging)."""
        model = self.roles[role].model
        return {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }

    def open_rendezvous(self, world: int) -> tuple[str, int]:
        """Rank 0: host the pool's process-group rendezvous (a ``TCPStore`` server on a port
        the OS picks, bound here and held until the group forms, so no other process can take
        it meanwhile); returns this node's IP and that port."""
        ip = ray.util.get_node_ip_address()
        self._rendezvous = open_rendezvous(ip, world, RENDEZVOUS_TIMEOUT.total_seconds())
        return ip, int(self._rendezvous.port)

    def init_process_group(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the process group of this pool at rank 0's rendezvous (``open_rendezvous``):
        gloo on the CPU; on CUDA NCCL for CUDA tensors and gloo for the CPU ones (the loss
        counts), after ``torch.cuda.set_device(local device)`` (the CUDA branch has not run
        on a GPU)."""
        import torch.distributed as dist

        from relayrl.model.device import resolve_device

        device = resolve_device(self.spec.cfg.model.device, self.device_rank)
        backend = "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        store = self._rendezvous if rank == 0 else None
        if store is None:
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=RENDEZVOUS_TIMEOUT
        )

    # ------------------------------------------------------------------ rollout engine
    def _engine_loop(self) -> None:
        assert self.engine is not None
        busy_since: float | None = None
        while True:
            with self._cv:
                while not self._stop and (
                    self._updates or self._torn or not self.engine.has_unfinished()
                ):
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
                    self._finished.append(error_sample(-1, r, str(exc)))
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
        """Load ``weights`` (None: this process's actor's) as ``version``; seconds it took.

        An FSDP2 actor's weights are gathered bucket by bucket on every rank of its group (a
        rank without an engine only joins the collective), and each bucket is loaded into the
        engine as it arrives: no rank holds more than one bucket of full tensors beyond the
        engine's own weights.
        """
        t0 = time.perf_counter()
        if weights is None and self._sharded_actor() and self.engine is None:
            self._gather(keep=False)
            return time.perf_counter() - t0
        assert self.engine is not None
        self._updates += 1
        try:
            with self._cv:
                if weights is None and self._sharded_actor():
                    self._load_buckets(version, interrupt)
                elif version != self.engine.version:
                    state = self._gather(keep=True) if weights is None else weights
                    self.engine.update_weights(state, version, interrupt=interrupt)
        finally:
            with self._cv:
                self._updates -= 1
                self._cv.notify_all()
        return time.perf_counter() - t0

    def _load_buckets(self, version: int, interrupt: bool) -> None:
        """The gather of an FSDP2 actor into this rank's engine, bucket by bucket (the
        caller holds the engine lock: no step runs on a half-loaded model). The first
        bucket makes ``version`` current (``update_weights``, non-strict), the others are
        copied into the engine's model; every key must arrive. The vLLM backend takes the
        whole dict at once."""
        from relayrl.workers.fsdp import iter_full_state_buckets

        engine, actor = self.engine, self.roles["actor"]
        assert engine is not None
        buckets = iter_full_state_buckets(actor.model, _sync_bytes(self.spec.cfg))
        load = version != engine.version  # the gather runs anyway: every rank must join
        if not isinstance(engine, RolloutEngine):  # vLLM: one dict
            state: dict[str, Tensor] = {}
            for b in buckets:
                state.update(b)
            if load:
                engine.update_weights(state, version, interrupt=interrupt)
            return
        seen: set[str] = set()
        for i, bucket in enumerate(buckets):
            if not load:
                continue
            if i == 0:
                engine.update_weights(bucket, version, interrupt=interrupt, strict=False)
            else:
                with torch.no_grad():
                    engine.model.load_state_dict(bucket, strict=False)
            seen.update(bucket)
        missing = set(engine.model.state_dict()) - seen if load else set()
        if missing:
            raise RuntimeError(f"weight sync: keys never gathered: {sorted(missing)[:5]}")

    def rollout_prioritize(self, group_ids: list[int]) -> None:
        assert self.engine is not None
        with self._cv:
            self.engine.prioritize(group_ids)

    def rollout_stats(self) -> tuple[dict[str, Any], list[tuple[float, float]]]:
        assert self.engine is not None
        with self._cv:
            spans, self._spans = self._spans, []
            return self.engine.stats(), spans

    def rollout_top_logprobs(self) -> bool:
        """The engine keeps ``top_logprobs`` alternatives (its ``supports_top_logprobs``)."""
        return bool(getattr(self.engine, "supports_top_logprobs", False))

    def shutdown(self) -> None:
        if self.engine is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()


# ray's stubs type remote()'s options overloads without max_concurrency (an actor option)
RoleHostActor = ray.remote(max_concurrency=16)(RoleHost)  # type: ignore[call-overload]


# --------------------------------------------------------------------------- worker groups
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


ERROR_GRACE_S = 5.0
"""After one rank's call failed: how long the others are waited for, so that their errors are
read too (a rank that fails alike, e.g. every rank's ``ShardedWriteError``, is done within it;
one stuck in a collective is not waited for)."""


def get_all(refs: list[Any]) -> list[Any]:
    """``ray.get`` of every rank's ref, in rank order. On the first failure (as soon as it
    comes: ``ray.get`` of the list fails fast too) the other ranks get ``ERROR_GRACE_S`` to
    finish and their results are read; then the lowest failed rank's error is raised. (Read
    once: an error left unread, as ``ray.get`` of the list leaves the others, is logged by Ray
    as an ``Unhandled error`` with its traceback after the run's one line.)"""
    index = {ref: i for i, ref in enumerate(refs)}
    out: list[Any] = [None] * len(refs)
    errors: dict[int, Exception] = {}

    def read(ready: list[Any]) -> None:
        for ref in ready:
            try:
                out[index[ref]] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - raised below, the others read first
                errors[index[ref]] = exc

    pending = list(refs)
    while pending and not errors:
        ready, pending = ray.wait(pending, num_returns=1)
        read(ready)
    if errors and pending:
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=ERROR_GRACE_S)
        read(ready)
    if errors:
        raise errors[min(errors)]
    return out


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
            return get_all([h.call.remote(role, method, *args) for h in self.hosts])[0]
        if mode == DP_SPLIT:
            if self.size == 1:
                return ray.get(self.hosts[0].call.remote(role, method, *args))
            shards = split_experience(args[0], self.size)
            refs = [
                h.call.remote(role, method, s, *args[1:])
                for h, s in zip(self.hosts, shards, strict=True)
            ]
            return gather(get_all(refs))
        raise ValueError(f"unknown dispatch mode {mode!r}")


class RemoteStateDict(Mapping[str, Tensor]):
    """A role's state dict that stays remote until someone reads it.

    A rollout replica colocated with the actor copies the weights in-process; a replica
    elsewhere gets ``.ref`` (the dict in Ray's object store, produced once by rank 0; for a
    ``sharded`` role every rank joins the gather and rank 0's result is the ref).
    """

    def __init__(self, group: WorkerGroup, role: str, sharded: bool = False):
        self.group, self.role, self.sharded = group, role, sharded
        self._ref: Any = None
        self._value: dict[str, Tensor] | None = None

    @property
    def ref(self) -> Any:
        if self._ref is None:
            hosts = self.group.hosts if self.sharded else self.group.hosts[:1]
            refs = [h.full_state.remote(self.role) for h in hosts]
            ray.get(refs[1:])  # the other ranks' parts of the collective ({} each)
            self._ref = refs[0]
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

    ``model`` is a controller-side copy refreshed from rank 0 on each access (checkpoints:
    the HF export; for a ``sharded`` (FSDP2) role gathered by every rank, bucket by bucket;
    ``own_keys``: a LoRA actor's peft model, so the checkpoint holds the adapter).
    """

    def __init__(
        self,
        group: WorkerGroup,
        role: str,
        load_shadow: Callable[[], torch.nn.Module],
        sharded: bool = False,
        own_keys: bool = False,
    ):
        self.group, self.role, self.sharded = group, role, sharded
        self._own_keys = own_keys  # the shadow takes the model's own state (LoRA: peft)
        self._dispatch = SHARDED_DISPATCH if sharded else DISPATCH
        self._load_shadow = load_shadow
        self._shadow: torch.nn.Module | None = None

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_") or method not in DISPATCH:
            raise AttributeError(method)
        mode = self._dispatch[method]
        return lambda *args: self.group.call(self.role, method, mode, *args)

    def state_dict(self) -> RemoteStateDict:
        return RemoteStateDict(self.group, self.role, self.sharded)

    @property
    def model(self) -> torch.nn.Module:
        if self._shadow is None:
            self._shadow = self._load_shadow()
        if self._own_keys:
            hosts = self.group.hosts if self.sharded else self.group.hosts[:1]
            state = ray.get([h.model_state.remote(self.role) for h in hosts])[0]
        else:
            state = ray.get(self.state_dict().ref)
        with torch.no_grad():
            self._shadow.load_state_dict(state)
        return self._shadow

"""The host side of ``weight_sync.transport: collective`` (mixed into ``RoleHost``).

The trainer's rank 0 and every rollout replica join one :class:`WeightGroup`
(``weights_join``, all at once, at build time). A sync is ``weights_send(version)`` on every
rank of the actor's pool (an FSDP2 actor: every rank joins the gathers, rank 0 broadcasts
each bucket) together with ``weights_receive(interrupt)`` on every replica, which loads each
bucket into its engine as it arrives (``RolloutEngine.update_weights_streamed``: keys and
shapes checked against the manifest before anything loads, the version made current after
the last bucket). The vLLM backend takes the whole dict at once (``update_weights``: its
deferred-update contract keeps the dict), so there the buckets are assembled first.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from relayrl.cluster.weight_collective import Entry, WeightGroup, drain, entries_of, plan_buckets


def _sync_bytes(cfg: Any) -> int:
    return int(cfg.model.fsdp.sync_bucket_mb * (1 << 20))


class CollectiveWeightSync:
    """``RoleHost`` methods of the collective transport (needs ``spec``, ``roles``,
    ``engine``, ``_cv``, ``_updates`` and ``_sharded_actor`` of the host)."""

    spec: Any
    roles: dict[str, Any]
    engine: Any
    _weight_group: WeightGroup | None = None

    def weights_backend(self) -> str:
        """gloo or nccl for the weight group (``weight_sync.backend``; ``auto``: NCCL when
        this (trainer rank 0) process computes on CUDA)."""
        from relayrl.model.device import resolve_device

        chosen = self.spec.cfg.weight_sync.backend
        if chosen != "auto":
            return str(chosen)
        device = resolve_device(self.spec.cfg.model.device, self.spec.rank)
        return "nccl" if device.type == "cuda" else "gloo"

    def weights_join(self, addr: str, port: int, rank: int, world: int, backend: str) -> None:
        """Join the weight group (every member at once: the rendezvous waits for all)."""
        self._weight_group = WeightGroup(
            addr, port, rank, world, backend, self.spec.cfg.weight_sync.timeout_s
        )

    def weights_send(self, version: int) -> float:
        """One sync from the actor (seconds). Under FSDP2 every rank of the pool calls it (the
        gathers are collectives of the trainer group); only the weight group's rank 0 sends."""
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
        group.send(version, plan_buckets(entries, bucket_bytes), tensors)
        return time.perf_counter() - t0

    def weights_receive(self, interrupt: bool) -> float:
        """One sync into this replica's engine (seconds)."""
        t0 = time.perf_counter()
        group = self._weight_group
        assert group is not None and self.engine is not None
        version, buckets, parts = group.receive()
        engine = self.engine
        self._updates += 1  # type: ignore[has-type]
        try:
            with self._cv:  # type: ignore[has-type]
                if version == engine.version:
                    drain(parts)  # already loaded (the first sync of a run): join, load nothing
                elif hasattr(engine, "update_weights_streamed"):
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
        finally:
            with self._cv:  # type: ignore[has-type]
                self._updates -= 1  # type: ignore[has-type]
                self._cv.notify_all()  # type: ignore[has-type]
        return time.perf_counter() - t0

    def engine_state(self) -> dict[str, Tensor]:
        """A copy of the engine's weights and its version (tests)."""
        assert self.engine is not None
        with self._cv:  # type: ignore[has-type]
            model = getattr(self.engine, "model", None)
            if model is None:
                raise RuntimeError("engine_state: this engine exposes no model")
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            state["__version__"] = torch.tensor(self.engine.version)
            return state

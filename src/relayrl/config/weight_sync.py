"""The weight-sync section of the run config (``weight_sync``): how the trainer's weights reach
rollout replicas that do not share its process.

Imports only ``relayrl.config.base``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.base import _Strict


class WeightSyncConfig(_Strict):
    """``cluster: ray``, rollout on a pool of its own (a colocated engine always copies the
    actor's weights in-process).

    ``object_store``: the trainer's rank 0 puts the full state dict in Ray's object store
    once and every replica fetches it (an FSDP2 actor gathers it bucket by bucket first).
    ``collective``: trainer rank 0 and every replica join a process group of their own (a
    TCPStore rendezvous at build time, separate from the trainer's data-parallel group) and
    rank 0 broadcasts a manifest (version, every key's shape and dtype, the bucket layout)
    then the weights as flat buckets of at most ``model.fsdp.sync_bucket_mb``; each replica
    loads a bucket as it arrives (one bucket in flight, every key checked against its model
    before anything loads) and makes the version current after the last. gloo on CPU, NCCL
    when the trainer's device is CUDA: the same code. A replica that dies is restarted under
    both transports (``ray.max_replica_restarts``). Under ``collective`` every survivor and
    trainer rank 0 leave the group and all, the new replica in the dead one's rank, form a new
    generation (a fresh rendezvous, the same world size); the new replica then gets the
    current weights and version as the first sync over it (at once if the actor has not
    changed since the last sync, else at the next one) and no request before. A member's
    death makes a pending broadcast fail (gloo: at once; NCCL: after ``timeout_s``); the
    replicas are probed through Ray before each sync."""

    transport: Literal["object_store", "collective"] = "object_store"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``collective``: ``auto`` = NCCL when the trainer's rank 0 computes on CUDA and the
    rollout pool has GPUs, else gloo; ``nccl`` to a pool without GPUs is refused before
    anything starts (``relayrl.cluster.placement_check``). NCCL needs a GPU per rank: two
    ranks on one GPU are refused, docs/gpu.md."""
    timeout_s: float = Field(600.0, gt=0)
    """How long a member of the weight group waits for the others (rendezvous, each
    broadcast) before failing; also the bound on each request of a weight update to a vLLM
    server process (``rollout.vllm_process``), past which the run stops naming the server
    and the version."""

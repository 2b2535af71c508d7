"""Weight sync over a process group of its own (``weight_sync.transport: collective``).

Trainer rank 0 (rank 0 here) and each rollout replica (ranks 1..R) join a group created from a
``TCPStore`` rendezvous on rank 0's node, separate from the trainer's data-parallel group, so
no other process has to join it: ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA
(the same calls; the NCCL branch has not run here). One sync is, all broadcasts from rank 0:

1. the manifest: an int64 length, then a JSON document as uint8 bytes: ``version`` and
   ``buckets``, a list of buckets, each a list of ``[name, shape, dtype]``;
2. every bucket as ONE flat uint8 buffer: its tensors' bytes back to back, each starting at a
   multiple of ``ALIGN`` bytes, so the receiver reads every tensor as a zero-copy view
   (``buf[offset : offset + nbytes].view(dtype).view(shape)``).

A bucket holds tensors in manifest order up to ``bucket_bytes`` (a tensor larger than that is
a bucket alone), the rule of ``relayrl.workers.fsdp.iter_full_state_buckets``, so a sharded
(FSDP2) actor can send each bucket as soon as its tensors are gathered: neither side holds
more than one bucket of full tensors beyond the model itself.

A group lives for one *generation*: when a replica dies, every survivor and rank 0
``close`` theirs and all members (the restarted replica in the dead one's rank, the same world
size) form the next generation on a fresh ``TCPStore`` (a new port; its keys prefixed with the
generation, so nothing of an older rendezvous is read). A member that died makes the others'
pending broadcasts fail (gloo: at once, the connection closes; NCCL: after ``timeout_s``).

Every failure of the group (a rendezvous a member never joined, a broadcast a member never
took part in, a peer that died) is a :class:`WeightSyncError` of one line naming this member
(trainer rank 0 sending to replicas ``0..R-1``, or replica ``r`` = rank ``r + 1``), the version
(when known: a sync's manifest carries it), the generation and ``weight_sync.timeout_s``: each
rendezvous and each broadcast waits at most ``timeout_s``, so a member that hangs is an error
within that bound, never a hang.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

ALIGN = 16
"""Byte alignment of each tensor inside a flat bucket (a ``view(dtype)`` needs the offset to
be a multiple of the element size)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the manifest."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight manifest: unknown dtype {name!r}")
    return dtype


def entries_of(state: Mapping[str, Tensor]) -> list[Entry]:
    """The manifest entries of a state dict (a DTensor's global shape: no gather)."""
    return [Entry(k, tuple(int(d) for d in v.shape), v.dtype) for k, v in state.items()]


def plan_buckets(entries: Sequence[Entry], bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped while the bucket stays within ``bucket_bytes`` (a larger
    tensor is a bucket alone): the rule of ``iter_full_state_buckets``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[Entry]] = []
    size = 0
    for e in entries:
        if buckets and buckets[-1] and size + e.nbytes <= bucket_bytes:
            buckets[-1].append(e)
            size += e.nbytes
        else:
            buckets.append([e])
            size = e.nbytes
    return buckets


def layout(bucket: Sequence[Entry]) -> tuple[list[int], int]:
    """Byte offset of each entry in the flat buffer (multiples of ``ALIGN``) and its size."""
    offsets, total = [], 0
    for e in bucket:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += e.nbytes
    return offsets, total


def pack(bucket: Sequence[Entry], tensors: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """The flat uint8 buffer of one bucket on ``device``."""
    offsets, total = layout(bucket)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for e, off in zip(bucket, offsets, strict=True):
        t = tensors[e.name]
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise ValueError(
                f"weight sync: {e.name!r} is {tuple(t.shape)} {t.dtype}, the manifest says "
                f"{e.shape} {e.dtype}"
            )
        view = buf[off : off + e.nbytes].view(e.dtype)
        view.copy_(t.detach().reshape(-1))
    return buf


def unpack(buf: Tensor, bucket: Sequence[Entry]) -> dict[str, Tensor]:
    """Zero-copy views of the tensors of one flat bucket."""
    offsets, total = layout(bucket)
    if buf.numel() != total:
        raise ValueError(f"weight sync: bucket of {buf.numel()} bytes, the layout has {total}")
    return {
        e.name: buf[off : off + e.nbytes].view(e.dtype).view(e.shape)
        for e, off in zip(bucket, offsets, strict=True)
    }


class _Backend(Protocol):
    """What ``WeightGroup`` calls on its c10d backend (``ProcessGroupNCCL`` /
    ``ProcessGroupGloo``, subclasses of ``torch._C._distributed_c10d.Backend``, whose stub
    declares neither method although every backend has both)."""

    def broadcast(self, tensors: list[Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def abort(self) -> None: ...


class WeightSyncError(RuntimeError):
    """A rendezvous or broadcast of the weight group failed or timed out (one line)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:400]


def open_rendezvous(host: str, world: int, timeout_s: float) -> dist.TCPStore:
    """A group's rendezvous server: a ``TCPStore`` on a port the OS picks (``.port``; it
    listens on every interface), bound now, so no other process can take the port before the
    group forms. The caller (the group's rank 0) holds it and hands it to the group."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)


class WeightGroup:
    """This process's membership of the weight-sync group (rank 0: the trainer's rank 0)."""

    def __init__(
        self,
        addr: str,
        port: int,
        rank: int,
        world: int,
        backend: str,
        timeout_s: float,
        generation: int = 0,
        server: dist.TCPStore | None = None,
    ):
        """``server``: rank 0's rendezvous (``open_rendezvous``) at ``port``; without it rank 0
        opens one at ``port``."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight_sync.backend: {backend!r} (gloo or nccl)")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend = rank, world, backend
        self.generation, self.timeout_s = generation, timeout_s
        self._tcp: dist.TCPStore | None = None
        self.pg: _Backend | None = None  # (torch's stubs: see _Backend)
        t0 = time.monotonic()
        try:
            if rank == 0 and server is not None:
                self._tcp = server
            else:
                self._tcp = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
            store = dist.PrefixStore(f"weights/{generation}/", self._tcp)
            if backend == "nccl":  # pragma: no cover - needs CUDA (not run here)
                self.device = torch.device("cuda", torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)  # type: ignore[assignment]
            else:
                self.device = torch.device("cpu")
                self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)  # type: ignore[assignment]
        except Exception as exc:
            self._tcp = None
            raise self._error("joining the group", None, t0, exc) from exc

    def who(self) -> str:
        """This member in words: trainer rank 0 (and the replicas it sends to) or replica r."""
        if self.rank == 0:
            return f"trainer rank 0 -> replicas 0..{self.world - 2} (ranks 1..{self.world - 1})"
        return f"replica {self.rank - 1} (rank {self.rank})"

    def _error(
        self, what: str, version: int | None, t0: float, exc: BaseException
    ) -> WeightSyncError:
        at = "" if version is None else f" of version {version}"
        return WeightSyncError(
            f"weight sync{at} failed: {self.who()} {what} in weight group generation "
            f"{self.generation}, after {time.monotonic() - t0:.1f} s "
            f"(weight_sync.timeout_s={self.timeout_s:g}): {_one_line(exc)}"
        )

    def close(self) -> None:
        """Leave the group (its generation ends): abort the process group (NCCL: a
        collective still waiting on a dead peer returns instead of running to the timeout)
        and drop the store (rank 0's holds the rendezvous server). Idempotent."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - a group whose peer died may refuse; it is dropped
                pass
        self._tcp = None

    def broadcast(self, tensor: Tensor) -> None:
        """Rank 0's ``tensor`` into every member's (same shape and dtype), in place."""
        if self.pg is None:
            raise RuntimeError(f"weight group generation {self.generation} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    # ------------------------------------------------------------------ manifest
    def send_manifest(self, version: int, buckets: Sequence[Sequence[Entry]]) -> None:
        doc = {
            "version": int(version),
            "buckets": [
                [[e.name, list(e.shape), str(e.dtype).removeprefix("torch.")] for e in b]
                for b in buckets
            ],
        }
        payload = json.dumps(doc).encode()
        self.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.device))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.broadcast(data)

    def recv_manifest(self) -> tuple[int, list[list[Entry]]]:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data)
        doc = json.loads(bytes(data.cpu().tolist()).decode())
        buckets = [
            [Entry(name, tuple(int(d) for d in shape), _dtype(dt)) for name, shape, dt in b]
            for b in doc["buckets"]
        ]
        return int(doc["version"]), buckets

    # ------------------------------------------------------------------ one sync
    def send(
        self,
        version: int,
        buckets: Sequence[Sequence[Entry]],
        tensors: Iterable[tuple[str, Tensor]],
    ) -> None:
        """Broadcast ``version`` and the weights: ``tensors`` yields (name, full tensor) in
        manifest order (a sharded actor gathers each when it is reached). A broadcast that
        fails or passes ``timeout_s`` is a :class:`WeightSyncError` naming the version."""
        t0 = time.monotonic()
        try:
            self._send(version, buckets, tensors)
        except WeightSyncError:
            raise
        except RuntimeError as exc:  # gloo / NCCL: a peer died or did not take part in time
            if "weight sync:" in str(exc) or "is closed" in str(exc):
                raise  # our own check (a manifest mismatch, a closed group): as it is
            raise self._error("sending", version, t0, exc) from exc

    def _send(
        self,
        version: int,
        buckets: Sequence[Sequence[Entry]],
        tensors: Iterable[tuple[str, Tensor]],
    ) -> None:
        self.send_manifest(version, buckets)
        it = iter(tensors)
        for bucket in buckets:
            part: dict[str, Tensor] = {}
            for e in bucket:
                name, t = next(it, (None, None))
                if name != e.name or t is None:
                    raise RuntimeError(f"weight sync: expected {e.name!r}, the model gave {name!r}")
                part[name] = t
            self.broadcast(pack(bucket, part, self.device))
        if next(it, None) is not None:
            raise RuntimeError("weight sync: the model has tensors the manifest does not list")

    def receive(self) -> tuple[int, list[list[Entry]], Iterator[dict[str, Tensor]]]:
        """(version, manifest, the buckets): each bucket is received when the iterator is
        advanced, and the iterator MUST be run to its end (the sender waits on every member;
        ``drain`` it after an error). A broadcast that fails or passes ``timeout_s`` is a
        :class:`WeightSyncError` naming this replica (and the version, once the manifest
        came)."""
        t0 = time.monotonic()
        try:
            version, buckets = self.recv_manifest()
        except RuntimeError as exc:
            if "is closed" in str(exc):
                raise
            raise self._error("receiving the manifest", None, t0, exc) from exc

        def parts() -> Iterator[dict[str, Tensor]]:
            for i, bucket in enumerate(buckets):
                buf = torch.empty(layout(bucket)[1], dtype=torch.uint8, device=self.device)
                try:
                    self.broadcast(buf)
                except RuntimeError as exc:
                    what = f"receiving bucket {i + 1} of {len(buckets)}"
                    raise self._error(what, version, t0, exc) from exc
                yield unpack(buf, bucket)

        return version, buckets, parts()


def drain(parts: Iterator[dict[str, Tensor]]) -> None:
    """Receive (and drop) the rest of a sync, so the sender is not left waiting."""
    for _ in parts:
        pass

"""Admission queue, slot table, and which sequences run in a step.

Every step the scheduler (1) admits waiting requests, oldest first, into free KV slots — a
slot freed in the previous step is refilled at once — and (2) runs every live sequence:
each one feeds the tokens whose KV is not in its slot yet. That is the whole prompt for a
fresh request or one that was interrupted (prefill / re-prefill), and the one last sampled
token otherwise (decode); prefill and decode rows share one forward. Sequences are grouped by
the weights they run under (several groups only while an ``interrupt=False`` weight update
lets old sequences finish on old weights).
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass, field

from relayrl.rollout.kv_cache import SlotKVCache
from relayrl.rollout.sampler import SamplingSettings
from relayrl.rollout.types import GenerationRequest


@dataclass(slots=True, eq=False)
class Sequence:
    """The engine's state of one request."""

    request_id: int
    request: GenerationRequest
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    settings: SamplingSettings
    max_tokens: int  # response budget, already capped by the context length
    stop_ids: frozenset[int]
    stop_on_eos: bool
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    num_computed: int = 0  # tokens whose KV is in the slot
    weights_version: int = -1  # which weights this sequence runs under (set at admission)
    num_interrupts: int = 0
    top: list[list[tuple[int, float]]] | None = None  # per token, ``top_logprobs``'s

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return len(self.tokens) - self.num_computed > 1


@dataclass(slots=True)
class ScheduledGroup:
    """Sequences that run in one forward, sorted by slot."""

    weights_version: int
    seqs: list[Sequence]


_slot = operator.attrgetter("slot")


class Scheduler:
    """FIFO admission into a fixed slot table; all live sequences run every step."""

    def __init__(self, kv_cache: SlotKVCache) -> None:
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # request id -> live sequence
        self.with_top = 0  # live sequences keeping alternatives (``Sequence.top``)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.with_top += seq.top is not None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, current_version: int) -> list[ScheduledGroup]:
        """Admit what fits, then return this step's forwards (one per weights version)."""
        while self.waiting and self.kv_cache.num_free:
            seq = self.waiting.popleft()
            seq.slot = self.kv_cache.allocate()
            seq.num_computed = 0
            seq.weights_version = current_version
            self.running[seq.request_id] = seq
        groups: dict[int, list[Sequence]] = {}
        for seq in self.running.values():
            groups.setdefault(seq.weights_version, []).append(seq)
        out = []
        for version in sorted(groups):
            seqs = groups[version]
            seqs.sort(key=_slot)
            out.append(ScheduledGroup(version, seqs))
        return out

    def finish(self, seq: Sequence) -> None:
        """Remove a live sequence and free its slot at once."""
        del self.running[seq.request_id]
        self.kv_cache.free(seq.slot)
        seq.slot = -1
        self.with_top -= seq.top is not None

    def remove(self, request_id: int) -> Sequence | None:
        """Take a request out wherever it is (for abort). None if unknown or finished."""
        seq = self.running.get(request_id)
        if seq is not None:
            self.finish(seq)
            return seq
        for i, seq in enumerate(self.waiting):
            if seq.request_id == request_id:
                del self.waiting[i]
                self.with_top -= seq.top is not None
                return seq
        return None

    def interrupt_all(self, new_version: int) -> int:
        """Drop the KV of every live sequence: they re-prefill under ``new_version``."""
        for seq in self.running.values():
            seq.num_computed = 0
            seq.weights_version = new_version
            seq.num_interrupts += 1
        return len(self.running)

    def versions_in_use(self) -> set[int]:
        return {seq.weights_version for seq in self.running.values()}

"""The simulator's moving parts: one episode in flight (:class:`Seq`) and one generation
replica doing continuous batching (:class:`Replica`).

A replica runs up to ``slots`` sequences. Between two events the batch is constant, so it
jumps ``k`` decode steps at once with :func:`relayrl.plan.timemodel.steps_time`; the cached
context of the batch after ``steps`` steps is ``s_ctx + n * steps`` with
``s_ctx = sum(ctx0 - start)`` over running sequences (``ctx0`` = tokens cached when the
sequence joined, ``start`` = the replica's step count then).

A multi-turn episode joins once per turn: turn ``j`` starts with ``ctx0 = prompt +`` the
tokens generated in turns ``< j`` ``+ j * obs_tokens`` (the observations), decodes
``turn_lengths[j]`` tokens, then leaves the replica while its environment runs.
"""

from __future__ import annotations

import heapq

from relayrl.plan.timemodel import TimeModel, steps_time, steps_within

__all__ = ["Replica", "Seq"]


class Seq:
    """One episode (a single-turn sample is a one-turn episode).

    ``segments`` lists ``(version, tokens)`` for every stretch of tokens generated under one
    weight version, across turns; ``waits`` the environment latency after each turn but the
    last (seconds).
    """

    __slots__ = (
        "id",
        "length",
        "ctx0",
        "start",
        "end",
        "seg_start",
        "version",
        "segments",
        "admitted_at",
        "admitted_version",
        "prompt",
        "finished_at",
        "turn_lengths",
        "waits",
        "turn",
        "obs",
        "env_wait_s",
    )

    def __init__(
        self,
        sid: int,
        turn_lengths: list[int],
        prompt: int,
        version: int,
        t: float,
        waits: list[float] | None = None,
        obs_tokens: int = 0,
    ) -> None:
        self.id = sid
        self.turn_lengths = turn_lengths
        self.waits = waits or []
        self.turn = 0
        self.obs = obs_tokens
        self.length = turn_lengths[0]  # tokens to decode in the current turn
        self.prompt = prompt
        self.ctx0 = prompt  # cached tokens when (re)joining a batch
        self.start = 0  # replica step count at join
        self.end = 0  # replica step count at which the current turn finishes
        self.seg_start = 0
        self.version = version
        self.segments: list[tuple[int, int]] = []
        self.admitted_at = t
        self.admitted_version = version
        self.finished_at = 0.0
        self.env_wait_s = 0.0

    @property
    def generated(self) -> int:
        """Model tokens of all turns (the trained, loss-masked-in tokens)."""
        return sum(self.turn_lengths)

    @property
    def total_tokens(self) -> int:
        """Prompt + every turn + every observation: the trained sequence length."""
        return self.prompt + self.generated + self.obs * (len(self.turn_lengths) - 1)

    def last_turn(self) -> bool:
        return self.turn >= len(self.turn_lengths) - 1

    def next_turn(self) -> None:
        """Move to the next turn; its context is everything so far plus one observation."""
        self.turn += 1
        self.length = self.turn_lengths[self.turn]
        self.ctx0 = self.prompt + sum(self.turn_lengths[: self.turn]) + self.obs * self.turn


class Replica:
    def __init__(self, rid: int, devices: int, slots: int, tm: TimeModel) -> None:
        self.id = rid
        self.devices = devices
        self.slots = slots
        self.tm = tm
        self.clock = 0.0
        self.steps = 0
        self.running: dict[int, Seq] = {}
        self.ends: list[tuple[int, int]] = []  # (end_step, seq id)
        self.s_ctx = 0  # sum(ctx0 - start): cached tokens = s_ctx + n * steps
        self.gen = 0  # invalidates stale heap events
        self._params: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.decode_steps = 0
        self.reprefill_s = 0.0
        self.prefill_s = 0.0
        self.resume_prefill_s = 0.0

    @property
    def n(self) -> int:
        return len(self.running)

    def free(self) -> int:
        return self.slots - self.n

    def refresh(self) -> None:
        if self.running:
            self._params = self.tm.decode_step_params(self.n, self.devices)

    def context(self) -> float:
        return self.s_ctx + self.n * self.steps

    def time_for(self, k: int) -> float:
        a, beta, g = self._params
        return steps_time(a, beta, g, self.n, self.context(), k)

    def steps_to_next_end(self) -> int:
        while self.ends and self.ends[0][1] not in self.running:
            heapq.heappop(self.ends)
        return self.ends[0][0] - self.steps if self.ends else 0

    def advance_steps(self, k: int) -> None:
        if k <= 0 or not self.running:
            return
        self.clock += self.time_for(k)
        self.steps += k
        self.decode_steps += k

    def advance_to(self, t: float) -> None:
        """Move to the first step boundary at or after ``t`` (idle replicas jump to ``t``)."""
        if not self.running:
            self.clock = max(self.clock, t)
            return
        if t <= self.clock:
            return
        a, beta, g = self._params
        k = steps_within(
            a, beta, g, self.n, self.context(), t - self.clock, self.steps_to_next_end()
        )
        self.advance_steps(k)

    def pop_finished(self) -> list[Seq]:
        """Sequences whose current turn ended at or before the current step."""
        done = []
        while self.ends and self.ends[0][0] <= self.steps:
            _, sid = heapq.heappop(self.ends)
            seq = self.running.pop(sid, None)
            if seq is None:
                continue
            self.s_ctx -= seq.ctx0 - seq.start
            seq.segments.append((seq.version, self.steps - seq.seg_start))
            done.append(seq)
        if done:
            self.refresh()
        return done

    def add(self, seqs: list[Seq], prefill_tokens: float | None = None) -> float:
        """Join at the current boundary after prefilling (batched); returns the prefill time.

        ``prefill_tokens`` defaults to every joiner's ``ctx0`` (a new prompt, or a returning
        episode whose KV was evicted while its environment ran)."""
        toks = sum(s.ctx0 for s in seqs) if prefill_tokens is None else prefill_tokens
        dt = self.tm.prefill_time(toks, self.devices)
        self.clock += dt
        self.prefill_s += dt
        for s in seqs:
            s.start = self.steps
            s.seg_start = self.steps
            s.end = self.steps + s.length
            self.running[s.id] = s
            self.s_ctx += s.ctx0 - s.start
            heapq.heappush(self.ends, (s.end, s.id))
        self.refresh()
        return dt

    def interrupt(self, version: int) -> None:
        """Drop the KV, re-prefill prompt + tokens so far; later tokens carry ``version``."""
        toks = 0.0
        for s in self.running.values():
            s.segments.append((s.version, self.steps - s.seg_start))
            s.seg_start = self.steps
            s.version = version
            toks += s.ctx0 + (self.steps - s.start)
        dt = self.tm.prefill_time(toks, self.devices)
        self.clock += dt
        self.reprefill_s += dt

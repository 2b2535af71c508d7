"""Event-driven simulator of RL schedules: continuous batching, staleness gate, interrupts.

One run simulates ``n_steps`` training steps of ``B`` samples each. Generation happens on
*replicas* (``gen_devices_per_replica`` devices each, tensor parallel) that do continuous
batching: each replica runs up to ``slots`` sequences, a finished sequence frees its slot at
once and the controller refills it when the staleness gate allows. Between two events the
composition of every batch is constant, so a replica jumps over many decode steps at once
(:func:`relayrl.plan.timemodel.steps_time`); events are completions, admissions, end of a
training step and arrival of new weights.

Schedules (one mechanism, three settings):

* ``sync`` - the same devices generate then train (colocated, time-shared). Gate with
  ``eta = 0``: batch ``k`` may only start once the trainer is at version ``k``, i.e. after
  training step ``k-1`` and its weight update. Every token has staleness 0.
* ``overlap`` - one-step off-policy: separate generation and training devices; batch ``k+1``
  is generated while batch ``k`` trains. Gate ``eta = 1`` plus a batch barrier (batch
  ``k+1`` starts only when batch ``k`` has finished generating): generation still waits for
  each batch's longest answer.
* ``async`` - AReaL: separate devices, continuous generation, gate
  ``floor((N_r - 1)/B) <= i + eta`` (:mod:`relayrl.plan.staleness`), the trainer takes the
  ``B`` samples admitted for its step as soon as they have all finished (``in_order``, the
  runtime's default ``async.in_order``: every token at most eta versions old), or with
  ``in_order=False`` the oldest ``B`` finished samples as soon as it is free. On a weight
  update, ``interrupt=True`` drops the KV of in-flight sequences and re-prefills prompt +
  tokens so far under the new weights (costed as a prefill; later tokens carry the new
  version); ``interrupt=False`` lets them finish under the weights they started with.

Staleness of a token = trainer version when it is trained - version that generated it.

Outputs (:class:`SimResult`): throughput (samples/s, response tokens/s, and a steady-state
figure over the second half of the steps), a time breakdown, generation utilisation over time
(running sequences / reference slots, where the reference is ``min(slots, B)`` for batch
schedules and all slots for ``async``), the share of generation time with fewer than 10% of
that reference running, the slot utilisation ``integral(running dt) / (slots * window)``, and
the per-token staleness histogram with its maximum.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from relayrl.plan.lengths import LengthDist
from relayrl.plan.staleness import admission_allowed, batch_index
from relayrl.plan.timemodel import TimeModel, steps_time, steps_within

__all__ = ["SimConfig", "SimResult", "simulate", "sparkline", "speedup"]

Schedule = Literal["sync", "overlap", "async"]


@dataclass
class SimConfig:
    """One simulated configuration.

    Attributes:
        time_model: decode/prefill/training costs (:mod:`relayrl.plan.timemodel`).
        lengths: response-length distribution (:mod:`relayrl.plan.lengths`).
        schedule: ``sync``, ``overlap`` or ``async``.
        n_devices: all devices of the run.
        train_devices: devices that train in ``overlap``/``async`` (the rest generate);
            ignored by ``sync`` (all devices do both). Default: a quarter.
        gen_devices_per_replica: tensor-parallel size of one generation replica.
        batch_size: samples per training step ``B``.
        n_steps: training steps to simulate.
        prompt_len: prompt tokens per sample.
        eta: staleness bound for ``async`` (``None`` = unbounded).
        interrupt: interrupt in-flight generation on weight updates (``async``).
        in_order: ``async`` trains step k on the samples admitted for step k, waiting for its
            stragglers (``async.in_order``); False: the oldest ``B`` finished samples.
        slots_per_replica: running-sequence cap per replica (default: the time model's KV
            limit for ``prompt_len + lengths.cap`` tokens).
        weight_sync_s: seconds to move new weights to the generators (default: 0 when
            colocated, ``weight_bytes / sync_bandwidth`` when split).
        sync_bandwidth: trainer -> generator bandwidth, bytes/s.
        seed: seeds the length draws.
        record_events: keep timeline spans (traces, plots) and one record per trained sample
            (id, admission version and time, finish time, version segments).
    """

    time_model: TimeModel
    lengths: LengthDist
    schedule: Schedule = "sync"
    n_devices: int = 16
    train_devices: int | None = None
    gen_devices_per_replica: int = 1
    batch_size: int = 512
    n_steps: int = 8
    prompt_len: int = 256
    eta: int | None = 2
    interrupt: bool = True
    in_order: bool = True
    slots_per_replica: int | None = None
    weight_sync_s: float | None = None
    sync_bandwidth: float = 25e9
    seed: int = 0
    record_events: bool = False

    def validate(self) -> None:
        if self.schedule not in ("sync", "overlap", "async"):
            raise ValueError(f"schedule must be sync, overlap or async, got {self.schedule!r}")
        if self.n_devices < 1 or self.batch_size < 1 or self.n_steps < 1:
            raise ValueError("n_devices, batch_size and n_steps must be >= 1")
        if self.prompt_len < 0:
            raise ValueError("prompt_len must be >= 0")
        if self.eta is not None and self.eta < 0:
            raise ValueError("eta must be >= 0 or None")
        if self.schedule != "sync":
            td = self.resolved_train_devices()
            if not 1 <= td < self.n_devices:
                raise ValueError(
                    f"train_devices must be in [1, n_devices - 1] for {self.schedule}, got {td}"
                )
        gen = self.gen_devices()
        if gen % self.gen_devices_per_replica:
            raise ValueError(
                f"{gen} generation devices are not a multiple of gen_devices_per_replica="
                f"{self.gen_devices_per_replica}"
            )

    def resolved_train_devices(self) -> int:
        if self.schedule == "sync":
            return self.n_devices
        return self.train_devices if self.train_devices is not None else max(1, self.n_devices // 4)

    def gen_devices(self) -> int:
        if self.schedule == "sync":
            return self.n_devices
        return self.n_devices - self.resolved_train_devices()


@dataclass
class SimResult:
    """What one simulation measured (times in seconds)."""

    config: dict[str, Any]
    makespan_s: float
    samples: int
    response_tokens: int
    samples_per_s: float
    tokens_per_s: float
    steady_samples_per_s: float
    step_end_times: list[float]
    breakdown: dict[str, float]
    slots: int
    reference_slots: int
    slot_utilisation: float
    low_utilisation_share: float
    utilisation_timeline: list[tuple[float, float]]
    staleness_hist: dict[int, int]
    max_staleness: int
    mean_staleness: float
    interrupted_fraction: float
    decode_steps: int
    events: list[dict[str, Any]] = field(default_factory=list)
    samples_log: list[dict[str, Any]] = field(default_factory=list)

    def staleness_quantile(self, q: float) -> int:
        """Token-weighted ``q``-quantile of staleness."""
        total = sum(self.staleness_hist.values())
        if total == 0:
            return 0
        acc = 0
        for s in sorted(self.staleness_hist):
            acc += self.staleness_hist[s]
            if acc >= q * total:
                return s
        return max(self.staleness_hist)

    def summary(self) -> dict[str, Any]:
        """Flat, JSON-friendly figures (no timelines)."""
        return {
            "schedule": self.config["schedule"],
            "eta": self.config["eta"],
            "interrupt": self.config["interrupt"],
            "makespan_s": round(self.makespan_s, 4),
            "samples_per_s": round(self.samples_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "steady_samples_per_s": round(self.steady_samples_per_s, 4),
            **{k: round(v, 4) for k, v in self.breakdown.items()},
            "slot_utilisation": round(self.slot_utilisation, 4),
            "low_utilisation_share": round(self.low_utilisation_share, 4),
            "mean_staleness": round(self.mean_staleness, 4),
            "max_staleness": self.max_staleness,
            "p99_staleness": self.staleness_quantile(0.99),
            "interrupted_fraction": round(self.interrupted_fraction, 4),
        }


class _Seq:
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
    )

    def __init__(self, sid: int, length: int, prompt: int, version: int, t: float) -> None:
        self.id = sid
        self.length = length
        self.prompt = prompt
        self.ctx0 = prompt  # cached tokens when (re)joining a batch
        self.start = 0  # replica step count at join
        self.end = 0  # replica step count at which it finishes
        self.seg_start = 0
        self.version = version
        self.segments: list[tuple[int, int]] = []
        self.admitted_at = t
        self.admitted_version = version
        self.finished_at = 0.0


class _Replica:
    def __init__(self, rid: int, devices: int, slots: int, tm: TimeModel) -> None:
        self.id = rid
        self.devices = devices
        self.slots = slots
        self.tm = tm
        self.clock = 0.0
        self.steps = 0
        self.running: dict[int, _Seq] = {}
        self.ends: list[tuple[int, int]] = []  # (end_step, seq id)
        self.s_ctx = 0  # sum(ctx0 - start): cached tokens = s_ctx + n * steps
        self.gen = 0  # invalidates stale heap events
        self._params: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.decode_steps = 0
        self.reprefill_s = 0.0
        self.prefill_s = 0.0

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

    def pop_finished(self) -> list[_Seq]:
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

    def add(self, seqs: list[_Seq]) -> None:
        """Join at the current boundary after prefilling their prompts (batched)."""
        toks = sum(s.ctx0 for s in seqs)
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


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration; see the module docstring for the model."""
    cfg.validate()
    tm = cfg.time_model
    sched = cfg.schedule
    colocated = sched == "sync"
    eta: int | None = 0 if sched == "sync" else 1 if sched == "overlap" else cfg.eta
    barrier = sched in ("sync", "overlap")
    interrupt = sched == "async" and cfg.interrupt
    B = cfg.batch_size
    rng = np.random.default_rng(cfg.seed)

    gen_devices = cfg.gen_devices()
    train_devices = cfg.resolved_train_devices()
    tp = cfg.gen_devices_per_replica
    n_rep = gen_devices // tp
    max_ctx = cfg.prompt_len + int(cfg.lengths.cap)
    slots = cfg.slots_per_replica or tm.max_concurrency(tp, max_ctx)
    if slots < 1:
        raise ValueError("slots_per_replica must be >= 1")
    reps = [_Replica(r, tp, slots, tm) for r in range(n_rep)]
    total_slots = slots * n_rep
    if cfg.weight_sync_s is not None:
        sync_s = cfg.weight_sync_s
    else:
        sync_s = 0.0 if colocated else tm.weight_bytes / cfg.sync_bandwidth

    need = cfg.n_steps * B
    # Batch schedules admit exactly the samples they train; async keeps its engine full to
    # the end (samples still running when the last step trains are simply not used).
    cap = need if barrier else need + total_slots
    pending: list[int] = []

    def draw() -> int:
        if not pending:
            chunk = [int(x) for x in cfg.lengths.sample(max(B, 256), rng)]
            pending.extend(reversed(chunk))
        return pending.pop()

    events: list[tuple[float, int, str, Any]] = []
    counter = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    admitted = 0
    gen_version = 0
    trainer_busy = False
    trained = 0
    buffer: list[tuple[int, _Seq]] = []
    finished_in_batch: dict[int, int] = {}
    batch_first: dict[int, float] = {}
    batch_last: dict[int, float] = {}
    deltas: list[tuple[float, int]] = []
    step_end: list[float] = []
    train_busy = 0.0
    sync_total = 0.0
    stale_hist: dict[int, int] = {}
    interrupted = 0
    trained_tokens = 0
    spans: list[dict[str, Any]] = []
    samples_log: list[dict[str, Any]] = []

    def schedule_rep(rep: _Replica) -> None:
        rep.gen += 1
        if rep.running:
            k = rep.steps_to_next_end()
            push(rep.clock + rep.time_for(k), "rep", (rep.id, rep.gen, k))

    def collect(rep: _Replica) -> None:
        for seq in rep.pop_finished():
            deltas.append((rep.clock, -1))
            seq.finished_at = rep.clock
            b = batch_index(seq.id, B)
            finished_in_batch[b] = finished_in_batch.get(b, 0) + 1
            batch_last[b] = max(batch_last.get(b, 0.0), rep.clock)
            heapq.heappush(buffer, (seq.id, seq))

    def batch_complete(b: int) -> bool:
        return finished_in_batch.get(b, 0) >= B

    def may_admit(n: int) -> bool:
        if n > cap or not admission_allowed(n, gen_version, eta, B):
            return False
        if barrier:
            b = batch_index(n, B)
            if b > 0 and not batch_complete(b - 1):
                return False
        return True

    def admit_all(t: float) -> None:
        nonlocal admitted
        if not may_admit(admitted + 1):
            return
        # A busy replica takes newcomers at its first step boundary at or after t.
        for r in reps:
            if r.free() > 0 and r.running and r.clock < t:
                r.advance_to(t)
                collect(r)
                schedule_rep(r)
        try_train(t)  # what was just collected may complete a batch
        new: dict[int, list[_Seq]] = {}
        order = sorted((r for r in reps if r.free() > 0), key=lambda r: (-r.free(), r.id))
        while order and may_admit(admitted + 1):
            progressed = False
            for r in order:
                if r.free() - len(new.get(r.id, [])) <= 0 or not may_admit(admitted + 1):
                    continue
                admitted += 1
                ts = max(t, r.clock)
                seq = _Seq(admitted, draw(), cfg.prompt_len, gen_version, ts)
                new.setdefault(r.id, []).append(seq)
                b = batch_index(admitted, B)
                batch_first.setdefault(b, ts)
                progressed = True
            if not progressed:
                break
        for rid, seqs in new.items():
            r = reps[rid]
            r.clock = max(r.clock, t)
            for _ in seqs:  # a sequence occupies its slot from its prefill on
                deltas.append((r.clock, +1))
            r.add(seqs)
            schedule_rep(r)

    def try_train(t: float) -> None:
        nonlocal trainer_busy, trained_tokens, interrupted, train_busy
        if trainer_busy or trained >= cfg.n_steps or len(buffer) < B:
            return
        if (barrier or cfg.in_order) and not batch_complete(trained):
            return
        batch = [heapq.heappop(buffer)[1] for _ in range(B)]
        t = max(t, max(s.finished_at for s in batch))
        toks = sum(s.prompt + s.length for s in batch)
        dur = tm.train_time(toks, train_devices)
        for s in batch:
            if sum(1 for _, c in s.segments if c > 0) > 1:
                interrupted += 1
            for ver, cnt in s.segments:
                if cnt <= 0:
                    continue
                st = trained - ver
                stale_hist[st] = stale_hist.get(st, 0) + cnt
            trained_tokens += s.length
            if cfg.record_events:
                samples_log.append(
                    {
                        "id": s.id,
                        "step": trained,
                        "admitted_version": s.admitted_version,
                        "admitted_at": s.admitted_at,
                        "finished_at": s.finished_at,
                        "segments": list(s.segments),
                    }
                )
        trainer_busy = True
        train_busy += dur
        if cfg.record_events:
            spans.append(
                {"lane": "train", "name": f"train step {trained}", "start": t, "end": t + dur}
            )
        push(t + dur, "train_done", trained)

    admit_all(0.0)
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == "rep":
            rid, gen, k = payload
            rep = reps[rid]
            if gen != rep.gen:
                continue
            rep.advance_steps(k)
            collect(rep)
            schedule_rep(rep)
            try_train(rep.clock)
            admit_all(rep.clock)
        elif kind == "train_done":
            trained += 1
            step_end.append(t)
            trainer_busy = False
            if trained >= cfg.n_steps:
                break
            sync_total += sync_s
            if cfg.record_events and sync_s > 0:
                spans.append(
                    {"lane": "sync", "name": f"weights v{trained}", "start": t, "end": t + sync_s}
                )
            push(t + sync_s, "weights", trained)
            if not colocated:
                try_train(t)
        elif kind == "weights":
            gen_version = payload
            if interrupt:
                for rep in reps:
                    if rep.running:
                        rep.advance_to(t)
                        collect(rep)
                        if rep.running:
                            rep.interrupt(gen_version)
                        schedule_rep(rep)
            try_train(t)
            admit_all(t)

    if trained < cfg.n_steps:
        raise RuntimeError("simulation stalled before finishing its steps")  # pragma: no cover
    makespan = step_end[-1]

    # Generation utilisation over time.
    ref = min(total_slots, B) if barrier else total_slots
    deltas.sort()
    times = [0.0]
    levels = [0]
    run = 0
    for tt, d in deltas:
        run += d
        if tt > makespan:
            break
        if tt == times[-1]:
            levels[-1] = run
        else:
            times.append(tt)
            levels.append(run)
    times.append(makespan)

    def integrate(lo: float, hi: float) -> tuple[float, float, float]:
        area = low = busy = 0.0
        for i in range(len(levels)):
            a, b = max(times[i], lo), min(times[i + 1], hi)
            if b <= a:
                continue
            area += levels[i] * (b - a)
            if levels[i] < 0.1 * ref:
                low += b - a
            if levels[i] > 0:
                busy += b - a
        return area, low, busy

    if barrier:
        windows = [
            (batch_first[b], batch_last[b])
            for b in range(cfg.n_steps)
            if b in batch_first and b in batch_last
        ]
    else:
        windows = [(0.0, makespan)]
    area = low = busy = span = 0.0
    for lo, hi in windows:
        a_, l_, b_ = integrate(lo, hi)
        area, low, busy, span = area + a_, low + l_, busy + b_, span + (hi - lo)
    slot_util = area / (ref * span) if span > 0 else 0.0
    low_share = low / span if span > 0 else 0.0
    bins = 40
    timeline = []
    for j in range(bins):
        lo, hi = makespan * j / bins, makespan * (j + 1) / bins
        a_, _, _ = integrate(lo, hi)
        timeline.append((lo, a_ / (ref * (hi - lo)) if hi > lo else 0.0))
    if cfg.record_events:
        for b, (lo, hi) in enumerate(windows):
            spans.append(
                {"lane": "generate", "name": f"generate batch {b}", "start": lo, "end": hi}
            )

    _, _, gen_busy = integrate(0.0, makespan)
    reprefill = sum(r.reprefill_s for r in reps) / max(1, n_rep)
    if colocated:
        gen_s = sum(hi - lo for lo, hi in windows)
        breakdown = {
            "generate_s": gen_s,
            "train_s": train_busy,
            "weight_sync_s": sync_total,
            "other_s": max(0.0, makespan - gen_s - train_busy - sync_total),
        }
    else:
        breakdown = {
            "generate_busy_s": gen_busy,
            "generate_idle_s": makespan - gen_busy,
            "train_s": train_busy,
            "trainer_idle_s": makespan - train_busy,
            "weight_sync_s": sync_total,
            "reprefill_s": reprefill,
        }
    half = cfg.n_steps // 2
    if half >= 1 and cfg.n_steps - half >= 1 and step_end[-1] > step_end[half - 1]:
        steady = (cfg.n_steps - half) * B / (step_end[-1] - step_end[half - 1])
    else:
        steady = cfg.n_steps * B / makespan
    total_tok = sum(stale_hist.values())
    mean_st = sum(s * c for s, c in stale_hist.items()) / total_tok if total_tok else 0.0
    conf = {
        "schedule": sched,
        "eta": eta if sched == "async" else (0 if sched == "sync" else 1),
        "interrupt": interrupt,
        "n_devices": cfg.n_devices,
        "gen_devices": gen_devices,
        "train_devices": train_devices,
        "replicas": n_rep,
        "batch_size": B,
        "n_steps": cfg.n_steps,
        "prompt_len": cfg.prompt_len,
        "weight_sync_s": sync_s,
    }
    return SimResult(
        config=conf,
        makespan_s=makespan,
        samples=cfg.n_steps * B,
        response_tokens=trained_tokens,
        samples_per_s=cfg.n_steps * B / makespan if makespan > 0 else math.inf,
        tokens_per_s=trained_tokens / makespan if makespan > 0 else math.inf,
        steady_samples_per_s=steady,
        step_end_times=step_end,
        breakdown=breakdown,
        slots=total_slots,
        reference_slots=ref,
        slot_utilisation=slot_util,
        low_utilisation_share=low_share,
        utilisation_timeline=timeline,
        staleness_hist=dict(sorted(stale_hist.items())),
        max_staleness=max(stale_hist) if stale_hist else 0,
        mean_staleness=mean_st,
        interrupted_fraction=interrupted / (cfg.n_steps * B),
        decode_steps=max((r.decode_steps for r in reps), default=0),
        events=spans,
        samples_log=samples_log,
    )


def speedup(a: SimResult, b: SimResult, steady: bool = True) -> float:
    """Throughput of ``a`` over ``b`` (samples/s ratio; steady-state by default)."""
    if steady:
        return a.steady_samples_per_s / b.steady_samples_per_s
    return a.samples_per_s / b.samples_per_s


_BARS = " ▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """Render fractions in [0, 1] as a bar string like the lecture's utilisation strip."""
    out = []
    for v in values:
        v = min(1.0, max(0.0, v))
        out.append(_BARS[min(len(_BARS) - 1, int(round(v * (len(_BARS) - 1))))])
    return "".join(out)

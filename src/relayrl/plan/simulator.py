"""Event-driven simulator of RL schedules: continuous batching, staleness gate, interrupts,
multi-turn episodes that wait on an environment.

One run simulates ``n_steps`` training steps of ``B`` samples each. Generation happens on
*replicas* (``gen_devices_per_replica`` devices each, tensor parallel) that do continuous
batching (:mod:`relayrl.plan.sim_replica`): each replica runs up to ``slots`` sequences, a
finished sequence frees its slot at once and the controller refills it when the schedule's
gate allows (:mod:`relayrl.plan.sim_policy`: ``sync``, ``overlap``, ``async``). Between two
events the composition of every batch is constant, so a replica jumps over many decode steps
at once; events are turn ends, admissions, environment returns, end of a training step and
arrival of new weights. On a weight update, ``interrupt=True`` drops the KV of in-flight
sequences and re-prefills prompt + tokens so far under the new weights (costed as a prefill;
later tokens carry the new version); ``interrupt=False`` lets them finish under the weights
they started with.

Multi-turn episodes (agent workloads; ``turns > 1``): an episode has ``T`` turns (an int or
a distribution), turn lengths drawn from ``lengths`` (tokens per turn), and after each turn
but the last an environment wait drawn from ``env_latency``
(:mod:`relayrl.plan.envlatency`), after which ``obs_tokens`` observation tokens join its
context. While it waits the episode holds no slot and its KV is evicted; when it returns it
rejoins before any new sample (no gate: it was admitted already) after prefilling its whole
context (``resume_prefill="context"``) or only the observation (``"observation"``: a prefix
cache kept its KV). ``async``: each episode waits alone and its slot serves others.
``sync``/``overlap``: the batch waits (turns run in lock-step; turn ``j + 1`` of a batch
starts when all its episodes have finished turn ``j`` plus the slowest of their waits). The
trained sequence is prompt + all turns + all observations; staleness counts model tokens.

Staleness of a token = trainer version when it is trained - version that generated it.

Outputs (:class:`~relayrl.plan.sim_report.SimResult`): throughput (samples/s, response
tokens/s, and a steady-state figure over the second half of the steps), a time breakdown,
generation utilisation over time, the share of generation time with fewer than 10% of the
reference slots running, the slot utilisation and the per-token staleness histogram.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from relayrl.plan.envlatency import LatencyDist
from relayrl.plan.lengths import LengthDist
from relayrl.plan.sim_policy import Schedule, SchedulePolicy
from relayrl.plan.sim_replica import Replica, Seq
from relayrl.plan.sim_report import Occupancy, SimResult, sparkline, speedup, steady_rate
from relayrl.plan.staleness import batch_index
from relayrl.plan.timemodel import TimeModel

__all__ = ["SimConfig", "SimResult", "simulate", "sparkline", "speedup"]


@dataclass
class SimConfig:
    """One simulated configuration.

    Attributes:
        time_model: decode/prefill/training costs (:mod:`relayrl.plan.timemodel`).
        lengths: response-length distribution, tokens (per turn when ``turns > 1``).
        schedule: ``sync``, ``overlap`` or ``async``.
        n_devices: all devices of the run.
        train_devices: devices that train in ``overlap``/``async`` (the rest generate);
            ignored by ``sync`` (all devices do both). Default: a quarter.
        gen_devices_per_replica: tensor-parallel size of one generation replica.
        batch_size: samples (episodes) per training step ``B``.
        n_steps: training steps to simulate.
        prompt_len: prompt tokens per sample.
        eta: staleness bound for ``async`` (``None`` = unbounded).
        interrupt: interrupt in-flight generation on weight updates (``async``).
        in_order: ``async`` trains step k on the samples admitted for step k, waiting for its
            stragglers (``async.in_order``); False: the oldest ``B`` finished samples.
        slots_per_replica: running-sequence cap per replica (default: the time model's KV
            limit for the longest episode's context).
        weight_sync_s: seconds to move new weights to the generators (default: 0 when
            colocated, ``weight_bytes / sync_bandwidth`` when split).
        sync_bandwidth: trainer -> generator bandwidth, bytes/s.
        seed: seeds the length, turn-count and latency draws (separate streams, so the same
            seed gives the same episodes under every schedule).
        record_events: keep timeline spans (traces, plots) and one record per trained sample
            (id, admission version and time, finish time, version segments).
        turns: turns per episode, an int or a distribution of ints >= 1 (e.g.
            ``ConstantLengths(4)``); 1 = single-turn samples.
        env_latency: environment wait after each turn but the last, seconds
            (:mod:`relayrl.plan.envlatency`); None = no wait.
        obs_tokens: observation tokens the environment appends per wait.
        resume_prefill: ``"context"`` (KV evicted while waiting: prefill everything so far)
            or ``"observation"`` (prefix cache hit: prefill only the observation).
        turn_barrier: ``sync``/``overlap`` run a batch's turns in lock-step (the batch waits
            for its slowest environment call); False: each episode goes on when its own
            environment returns (an agent loop per episode; the step still waits for the
            whole batch). ``async`` episodes are always independent.
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
    turns: int | LengthDist = 1
    env_latency: LatencyDist | None = None
    obs_tokens: int = 0
    resume_prefill: str = "context"
    turn_barrier: bool = True

    def validate(self) -> None:
        if self.schedule not in ("sync", "overlap", "async"):
            raise ValueError(f"schedule must be sync, overlap or async, got {self.schedule!r}")
        if self.n_devices < 1 or self.batch_size < 1 or self.n_steps < 1:
            raise ValueError("n_devices, batch_size and n_steps must be >= 1")
        if self.prompt_len < 0:
            raise ValueError("prompt_len must be >= 0")
        if self.eta is not None and self.eta < 0:
            raise ValueError("eta must be >= 0 or None")
        if isinstance(self.turns, int) and self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.obs_tokens < 0:
            raise ValueError(f"obs_tokens must be >= 0, got {self.obs_tokens}")
        if self.resume_prefill not in ("context", "observation"):
            raise ValueError(
                f"resume_prefill must be 'context' or 'observation', got {self.resume_prefill!r}"
            )
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

    def max_turns(self) -> int:
        return self.turns if isinstance(self.turns, int) else int(self.turns.cap)

    def max_context(self) -> int:
        """Longest episode: prompt + every turn at the cap + every observation (tokens)."""
        t = self.max_turns()
        return self.prompt_len + t * int(self.lengths.cap) + (t - 1) * self.obs_tokens


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration; see the module docstring for the model."""
    cfg.validate()
    tm = cfg.time_model
    pol = SchedulePolicy.of(cfg.schedule, cfg.eta, cfg.interrupt, cfg.in_order)
    lockstep = pol.barrier and cfg.turn_barrier
    B = cfg.batch_size
    rng = np.random.default_rng(cfg.seed)
    turn_rng = np.random.default_rng([cfg.seed, 1])
    lat_rng = np.random.default_rng([cfg.seed, 2])

    gen_devices = cfg.gen_devices()
    train_devices = cfg.resolved_train_devices()
    tp = cfg.gen_devices_per_replica
    n_rep = gen_devices // tp
    slots = cfg.slots_per_replica or tm.max_concurrency(tp, cfg.max_context())
    if slots < 1:
        raise ValueError("slots_per_replica must be >= 1")
    reps = [Replica(r, tp, slots, tm) for r in range(n_rep)]
    total_slots = slots * n_rep
    if cfg.weight_sync_s is not None:
        sync_s = cfg.weight_sync_s
    else:
        sync_s = 0.0 if pol.colocated else tm.weight_bytes / cfg.sync_bandwidth

    need = cfg.n_steps * B
    # Batch schedules admit exactly the samples they train; async keeps its engine full to
    # the end (samples still running when the last step trains are simply not used).
    cap = need if pol.barrier else need + total_slots
    pending: list[int] = []

    def draw() -> int:
        if not pending:
            chunk = [int(x) for x in cfg.lengths.sample(max(B, 256), rng)]
            pending.extend(reversed(chunk))
        return pending.pop()

    def new_episode(sid: int, t: float) -> Seq:
        if isinstance(cfg.turns, int):
            n_turns = cfg.turns
        else:
            n_turns = max(1, int(cfg.turns.sample(1, turn_rng)[0]))
        lens = [draw() for _ in range(n_turns)]
        waits: list[float] = []
        if n_turns > 1 and cfg.env_latency is not None:
            waits = [float(w) for w in cfg.env_latency.sample(n_turns - 1, lat_rng)]
        elif n_turns > 1:
            waits = [0.0] * (n_turns - 1)
        return Seq(sid, lens, cfg.prompt_len, gen_version, t, waits, cfg.obs_tokens)

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
    buffer: list[tuple[int, Seq]] = []
    resume: list[Seq] = []  # back from the environment, waiting for a slot (FIFO)
    turn_wait: dict[int, list[Seq]] = {}  # lock-step: batch -> episodes done with this turn
    turn_done: dict[int, int] = {}
    turn_expected: dict[int, int] = {}
    batch_env_wait = 0.0
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
    trained_env_wait = 0.0
    spans: list[dict[str, Any]] = []
    samples_log: list[dict[str, Any]] = []

    def schedule_rep(rep: Replica) -> None:
        rep.gen += 1
        if rep.running:
            k = rep.steps_to_next_end()
            push(rep.clock + rep.time_for(k), "rep", (rep.id, rep.gen, k))

    def batch_complete(b: int) -> bool:
        return finished_in_batch.get(b, 0) >= B

    def turn_ended(seq: Seq, t: float) -> None:
        """Lock-step turns: when the whole batch is through this turn, it waits together."""
        nonlocal batch_env_wait
        b = batch_index(seq.id, B)
        turn_done[b] = turn_done.get(b, 0) + 1
        if turn_done[b] < turn_expected.get(b, B):
            return
        waiting = turn_wait.pop(b, [])
        turn_done[b] = 0
        turn_expected[b] = len(waiting)
        if not waiting:
            return
        w = max(s.waits[s.turn] for s in waiting)
        for s in waiting:
            s.env_wait_s += w
        batch_env_wait += w
        if cfg.record_events:
            spans.append({"lane": "env", "name": f"env batch {b}", "start": t, "end": t + w})
        push(t + w, "env", waiting)

    def collect(rep: Replica) -> None:
        for seq in rep.pop_finished():
            deltas.append((rep.clock, -1))
            b = batch_index(seq.id, B)
            if not seq.last_turn():
                if lockstep:
                    turn_wait.setdefault(b, []).append(seq)
                    turn_ended(seq, rep.clock)
                else:
                    w = seq.waits[seq.turn]
                    seq.env_wait_s += w
                    push(rep.clock + w, "env", [seq])
                continue
            seq.finished_at = rep.clock
            finished_in_batch[b] = finished_in_batch.get(b, 0) + 1
            batch_last[b] = max(batch_last.get(b, 0.0), rep.clock)
            heapq.heappush(buffer, (seq.id, seq))
            if lockstep:
                turn_ended(seq, rep.clock)

    def may_admit(n: int) -> bool:
        return pol.may_admit(n, gen_version, B, cap, batch_complete)

    def admit_all(t: float) -> None:
        nonlocal admitted
        if not resume and not may_admit(admitted + 1):
            return
        # A busy replica takes newcomers at its first step boundary at or after t.
        for r in reps:
            if r.free() > 0 and r.running and r.clock < t:
                r.advance_to(t)
                collect(r)
                schedule_rep(r)
        try_train(t)  # what was just collected may complete a batch
        new: dict[int, list[Seq]] = {}
        back: dict[int, list[Seq]] = {}
        order = sorted((r for r in reps if r.free() > 0), key=lambda r: (-r.free(), r.id))
        while order and (resume or may_admit(admitted + 1)):
            progressed = False
            for r in order:
                if r.free() - len(new.get(r.id, [])) - len(back.get(r.id, [])) <= 0:
                    continue
                if resume:  # returning episodes first: they hold a place in a batch
                    seq = resume.pop(0)
                    seq.version = gen_version
                    back.setdefault(r.id, []).append(seq)
                elif may_admit(admitted + 1):
                    admitted += 1
                    ts = max(t, r.clock)
                    new.setdefault(r.id, []).append(new_episode(admitted, ts))
                    batch_first.setdefault(batch_index(admitted, B), ts)
                else:
                    continue
                progressed = True
            if not progressed:
                break
        for rid in sorted(set(new) | set(back)):
            r = reps[rid]
            r.clock = max(r.clock, t)
            joiners = new.get(rid, []) + back.get(rid, [])
            for _ in joiners:  # a sequence occupies its slot from its prefill on
                deltas.append((r.clock, +1))
            if rid in new:
                r.add(new[rid])
            if rid in back:
                toks = None if cfg.resume_prefill == "context" else cfg.obs_tokens * len(back[rid])
                r.resume_prefill_s += r.add(back[rid], toks)
            schedule_rep(r)

    def try_train(t: float) -> None:
        nonlocal trainer_busy, trained_tokens, interrupted, train_busy, trained_env_wait
        if trainer_busy or trained >= cfg.n_steps:
            return
        if not pol.may_train(trained, len(buffer), B, batch_complete):
            return
        batch = [heapq.heappop(buffer)[1] for _ in range(B)]
        t = max(t, max(s.finished_at for s in batch))
        toks = sum(s.total_tokens for s in batch)
        dur = tm.train_time(toks, train_devices)
        for s in batch:
            if len({v for v, c in s.segments if c > 0}) > 1:
                interrupted += 1
            for ver, cnt in s.segments:
                if cnt <= 0:
                    continue
                st = trained - ver
                stale_hist[st] = stale_hist.get(st, 0) + cnt
            trained_tokens += s.generated
            trained_env_wait += s.env_wait_s
            if cfg.record_events:
                samples_log.append(
                    {
                        "id": s.id,
                        "step": trained,
                        "admitted_version": s.admitted_version,
                        "admitted_at": s.admitted_at,
                        "finished_at": s.finished_at,
                        "segments": list(s.segments),
                        "turns": len(s.turn_lengths),
                        "env_wait_s": s.env_wait_s,
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
        elif kind == "env":
            for seq in payload:
                seq.next_turn()
                resume.append(seq)
            admit_all(t)
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
            if not pol.colocated:
                try_train(t)
        elif kind == "weights":
            gen_version = payload
            if pol.interrupt:
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

    ref = min(total_slots, B) if pol.barrier else total_slots
    occ = Occupancy(deltas, makespan, ref)
    if pol.barrier:
        windows = [
            (batch_first[b], batch_last[b])
            for b in range(cfg.n_steps)
            if b in batch_first and b in batch_last
        ]
    else:
        windows = [(0.0, makespan)]
    slot_util, low_share = occ.over(windows)
    if cfg.record_events:
        for b, (lo, hi) in enumerate(windows):
            spans.append(
                {"lane": "generate", "name": f"generate batch {b}", "start": lo, "end": hi}
            )

    _, _, gen_busy = occ.integrate(0.0, makespan)
    reprefill = sum(r.reprefill_s for r in reps) / max(1, n_rep)
    multi_turn = cfg.max_turns() > 1
    if pol.colocated:
        win_s = sum(hi - lo for lo, hi in windows)
        gen_s = win_s - batch_env_wait
        breakdown = {
            "generate_s": gen_s,
            "train_s": train_busy,
            "weight_sync_s": sync_total,
            "other_s": max(0.0, makespan - win_s - train_busy - sync_total),
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
    if multi_turn:
        # env_wait_s: run time the lock-stepped batches spent blocked on environments;
        # episode_env_wait_s: mean total wait of one trained episode (any schedule).
        if lockstep:
            breakdown["env_wait_s"] = batch_env_wait
        breakdown["episode_env_wait_s"] = trained_env_wait / need
        breakdown["resume_prefill_s"] = sum(r.resume_prefill_s for r in reps) / max(1, n_rep)
    total_tok = sum(stale_hist.values())
    mean_st = sum(s * c for s, c in stale_hist.items()) / total_tok if total_tok else 0.0
    conf = {
        "schedule": pol.name,
        "eta": pol.eta,
        "interrupt": pol.interrupt,
        "n_devices": cfg.n_devices,
        "gen_devices": gen_devices,
        "train_devices": train_devices,
        "replicas": n_rep,
        "batch_size": B,
        "n_steps": cfg.n_steps,
        "prompt_len": cfg.prompt_len,
        "weight_sync_s": sync_s,
        "turns": cfg.max_turns() if isinstance(cfg.turns, int) else repr(cfg.turns),
        "obs_tokens": cfg.obs_tokens,
    }
    return SimResult(
        config=conf,
        makespan_s=makespan,
        samples=need,
        response_tokens=trained_tokens,
        samples_per_s=need / makespan if makespan > 0 else math.inf,
        tokens_per_s=trained_tokens / makespan if makespan > 0 else math.inf,
        steady_samples_per_s=steady_rate(step_end, B),
        step_end_times=step_end,
        breakdown=breakdown,
        slots=total_slots,
        reference_slots=ref,
        slot_utilisation=slot_util,
        low_utilisation_share=low_share,
        utilisation_timeline=occ.timeline(),
        staleness_hist=dict(sorted(stale_hist.items())),
        max_staleness=max(stale_hist) if stale_hist else 0,
        mean_staleness=mean_st,
        interrupted_fraction=interrupted / need,
        decode_steps=max((r.decode_steps for r in reps), default=0),
        events=spans,
        samples_log=samples_log,
    )

"""ReaLHF-style execution-plan search for the six-call PPO dataflow.

The dataflow (ReaLHF, Mei et al. 2024)::

    actor_gen -> {ref_inf, reward_inf, critic_inf} -> {actor_train, critic_train}
    next iteration: actor_gen after actor_train, critic_inf after critic_train

A *plan* gives each call a device mesh (an aligned block of GPUs inside one node - 1, 2, 4,
... GPUs - or a run of whole nodes) and a strategy ``(dp, tp, pp)`` with
``dp * tp * pp = mesh size`` and ``tp`` inside a node.

Cost of a plan = simulated time of ``iterations`` consecutive iterations / ``iterations``:
calls start when their dependencies are done and every GPU of their mesh is free (calls on
disjoint meshes overlap); a call whose model is not laid out as it needs is preceded by a
*parameter reallocation* (the trained models live in their training layout; the generation
and critic-inference copies are rebuilt each iteration). Per-call times (``S`` GPUs, peak
``P``, ``mfu``, bandwidth ``BW``, efficiency ``e``, ``T`` tokens = ``B (prompt + gen)``):

* training ``6 N T / (S P mfu) * bubble + TP all-reduces + DP gradient all-reduce``
* inference ``2 N T / (S P mfu) * bubble + TP all-reduces``
* generation ``gen * max((W/tp + KV_b/(tp pp)) / (BW e), 2 N b / (tp pp P mfu))
  + gen * 2 L alpha [tp > 1] + prefill`` with ``b = B/dp`` sequences per replica and a
  latency ``alpha`` per tensor-parallel all-reduce (what makes decoding prefer data
  parallelism: ReaLHF's measured plan decodes with (dp, tp, pp) = (8, 1, 2))
* ``bubble = (m + pp - 1) / m`` with ``m`` micro-batches; a TP all-reduce of ``x`` bytes costs
  ``2 (tp-1)/tp x / BW_nvlink``; the DP gradient all-reduce ``2 (dp-1)/dp * 2N/(tp pp) / BW``.
* reallocation: every destination GPU receives the part of its new shard it does not hold
  already (intervals of ``[0, 1)`` as in :mod:`relayrl.plan.reshard`; destination ranks are
  ordered by what they hold, HybridFlow's grouping); time = largest receive / bandwidth
  (NVLink if both layouts sit in one node, else the network).

Memory check, per GPU: a trained model keeps, on its training mesh, what
:meth:`relayrl.plan.memory.TrainMemoryModel.persistent_bytes` counts between updates (fp32
master weights and AdamW state, sharded over ``dp`` by FSDP2 when ``dp > 1``) of its
``N/(tp pp)`` parameters; frozen models keep ``2 N/(tp pp)`` on their inference mesh; on top,
the largest transient of the calls that run there: a reallocated copy ``2 N/(tp pp)``, the KV
cache ``b (prompt + gen) kv/(tp pp)`` of generation, and for training the rest of the
two-phase peak (``peak_bytes - persistent_bytes``: gradients, bf16 weight copies,
activations, logits, the foreach AdamW temporary), so a training mesh holds exactly
``peak_bytes`` (:meth:`PPOProblem.train_memory`) of the per-rank shape: ``h/tp`` hidden,
``L/pp`` layers, ``V/tp`` vocabulary (vocab-parallel logits), an lm_head shard ``V h/tp``,
bf16 mixed precision, foreach AdamW (CUDA's default), micro-batches of
``micro_batch_tokens`` with the response share ``gen/(prompt + gen)``, the actor's lm_head on
the ``gen + 1`` last positions of a row and its logprobs chunked (as the trainer computes
them). The coefficients are the CPU fit ``CALIBRATED`` (three model sizes, a fourth held
out): on GPUs an extrapolation. It must fit ``memory_fraction`` of the device (the rest for
the CUDA context and NCCL buffers).

Search (:func:`search_plan`): simulated annealing (Metropolis-Hastings on
``exp(-cost / temperature)``, temperature decaying geometrically from ``t0 * cost0`` to
``t_end * cost0``), each move re-draws one call's (mesh, strategy); plans failing the memory
check have their cost multiplied by a large penalty and are never returned. The chain starts
from a greedy plan (the cheaper of the coordinate descents from the heuristic and from the
symmetric plan) and keeps the best feasible plan it sees. Baselines: :func:`heuristic_plan`
(every call on all GPUs, tensor parallel inside nodes, pipeline across nodes),
:func:`symmetric_plan` (every call on all GPUs, data parallel across nodes) and
:func:`asymmetric_plan` (OpenRLHF-like disjoint meshes).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from relayrl.plan.hardware import HardwareSpec
from relayrl.plan.memory import CALIBRATED, TrainMemoryModel, TrainShape
from relayrl.plan.models import ModelSpec
from relayrl.plan.reshard import interval_length

__all__ = [
    "CALLS",
    "Call",
    "Mesh",
    "Plan",
    "PlanEval",
    "PPOProblem",
    "Strategy",
    "asymmetric_plan",
    "greedy_plan",
    "heuristic_plan",
    "search_plan",
    "symmetric_plan",
]


@dataclass(frozen=True)
class Call:
    name: str
    role: str
    kind: str  # gen | inf | train


CALLS: tuple[Call, ...] = (
    Call("actor_gen", "actor", "gen"),
    Call("ref_inf", "ref", "inf"),
    Call("reward_inf", "reward", "inf"),
    Call("critic_inf", "critic", "inf"),
    Call("actor_train", "actor", "train"),
    Call("critic_train", "critic", "train"),
)
_DEPS: dict[str, tuple[str, ...]] = {
    "actor_gen": (),
    "ref_inf": ("actor_gen",),
    "reward_inf": ("actor_gen",),
    "critic_inf": ("actor_gen",),
    "actor_train": ("ref_inf", "reward_inf", "critic_inf"),
    "critic_train": ("ref_inf", "reward_inf", "critic_inf"),
}
_PREV: dict[str, str] = {"actor_gen": "actor_train", "critic_inf": "critic_train"}
_HOME = {"actor": "actor_train", "critic": "critic_train", "ref": "ref_inf", "reward": "reward_inf"}


@dataclass(frozen=True)
class Mesh:
    """GPUs ``[start, start + size)`` of the cluster (global ids, node-major)."""

    start: int
    size: int

    @property
    def gpus(self) -> range:
        return range(self.start, self.start + self.size)

    def __str__(self) -> str:
        return f"gpu{self.start}-{self.start + self.size - 1}"


@dataclass(frozen=True)
class Strategy:
    dp: int
    tp: int
    pp: int

    def __str__(self) -> str:
        return f"({self.dp},{self.tp},{self.pp})"


Plan = dict[str, tuple[Mesh, Strategy]]


@dataclass
class PPOProblem:
    """Models, cluster and batch of the dataflow (cost constants in the module docstring).

    Attributes:
        models: role -> spec for actor, critic, ref, reward.
        hardware: device spec (its node size and bandwidths are used).
        n_nodes: nodes in the cluster.
        batch: prompts per iteration ``B`` (one response each).
        prompt_len, gen_len: tokens.
        mfu, decode_efficiency: efficiencies.
        tp_latency_s: latency of one tensor-parallel all-reduce while decoding (``alpha``).
        micro_batches: pipeline micro-batches ``m``.
        micro_batch_tokens: tokens per training micro-batch (activation memory).
        memory_fraction: usable share of device memory.
        memory_model: the training-memory model (``relayrl.plan.memory``; calibrated).
    """

    models: dict[str, ModelSpec]
    hardware: HardwareSpec
    n_nodes: int = 2
    batch: int = 512
    prompt_len: int = 128
    gen_len: int = 896
    mfu: float = 0.4
    decode_efficiency: float = 0.6
    tp_latency_s: float = 10e-6
    micro_batches: int = 8
    micro_batch_tokens: int = 8192
    memory_fraction: float = 0.95
    memory_model: TrainMemoryModel = CALIBRATED
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        missing = {"actor", "critic", "ref", "reward"} - set(self.models)
        if missing:
            raise ValueError(f"problem lacks models for {', '.join(sorted(missing))}")
        if self.n_nodes < 1 or self.batch < 1:
            raise ValueError("n_nodes and batch must be >= 1")

    @property
    def gpn(self) -> int:
        return self.hardware.gpus_per_node

    @property
    def n_gpus(self) -> int:
        return self.n_nodes * self.gpn

    @property
    def tokens(self) -> int:
        return self.batch * (self.prompt_len + self.gen_len)

    # -- search space ---------------------------------------------------------------------
    def meshes(self) -> list[Mesh]:
        out = []
        size = 1
        while size <= self.gpn:
            for node in range(self.n_nodes):
                for off in range(0, self.gpn, size):
                    out.append(Mesh(node * self.gpn + off, size))
            size *= 2
        for k in range(2, self.n_nodes + 1):
            for node in range(self.n_nodes - k + 1):
                out.append(Mesh(node * self.gpn, k * self.gpn))
        return out

    def strategies(self, mesh: Mesh, role: str) -> list[Strategy]:
        m = self.models[role]
        out = []
        tp = 1
        while tp <= min(mesh.size, self.gpn):
            if mesh.size % tp == 0 and m.heads % tp == 0:
                rest = mesh.size // tp
                for pp in range(1, rest + 1):
                    if rest % pp == 0 and pp <= m.layers:
                        out.append(Strategy(rest // pp, tp, pp))
            tp *= 2
        return out

    def options(self, call: Call) -> list[tuple[Mesh, Strategy]]:
        key = ("options", call.name)
        if key not in self._cache:
            opts = [(me, s) for me in self.meshes() for s in self.strategies(me, call.role)]
            self._cache[key] = [o for o in opts if o[1].dp <= self.batch]
        return self._cache[key]

    # -- costs ----------------------------------------------------------------------------
    def _bw(self, gpus: set[int] | range) -> float:
        nodes = {g // self.gpn for g in gpus}
        return (
            self.hardware.intra_node_bandwidth
            if len(nodes) <= 1
            else self.hardware.inter_node_bandwidth
        )

    def _ar(self, nbytes: float, n: int, bw: float) -> float:
        return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw

    def call_time(self, call: Call, mesh: Mesh, s: Strategy) -> float:
        """Seconds for one call, excluding reallocation."""
        key = ("time", call.name, mesh, s)
        if key in self._cache:
            return self._cache[key]
        m = self.models[call.role]
        hw = self.hardware
        S = mesh.size
        bubble = (self.micro_batches + s.pp - 1) / self.micro_batches
        nvl = hw.intra_node_bandwidth
        if call.kind == "gen":
            b = math.ceil(self.batch / s.dp)
            ctx = self.prompt_len + self.gen_len / 2
            mem = (m.weight_bytes / s.tp + b * ctx * m.kv_bytes_per_token / (s.tp * s.pp)) / (
                hw.mem_bandwidth * self.decode_efficiency
            )
            comp = 2 * m.params * b / (s.tp * s.pp * hw.peak_flops * self.mfu)
            lat = 2 * m.layers * self.tp_latency_s if s.tp > 1 else 0.0
            prefill = 2 * m.params * self.batch * self.prompt_len / (S * hw.peak_flops * self.mfu)
            t = self.gen_len * (max(mem, comp) + lat) + prefill
        else:
            f = 6.0 if call.kind == "train" else 2.0
            n_ar = 4 if call.kind == "train" else 2
            t = f * m.params * self.tokens / (S * hw.peak_flops * self.mfu) * bubble
            act = (self.tokens / s.dp) * m.hidden * 2.0
            t += (m.layers / s.pp) * n_ar * self._ar(act, s.tp, nvl) * bubble
            if call.kind == "train":
                grads = m.weight_bytes / (s.tp * s.pp)
                t += self._ar(grads, s.dp, self._bw(mesh.gpus))
        self._cache[key] = t
        return t

    def _pieces(self, mesh: Mesh, s: Strategy) -> dict[int, tuple[Fraction, Fraction]]:
        n = s.tp * s.pp
        out = {}
        for r, g in enumerate(mesh.gpus):
            k = r % n
            out[g] = (Fraction(k, n), Fraction(k + 1, n))
        return out

    def realloc_time(
        self, role: str, src: tuple[Mesh, Strategy], dst: tuple[Mesh, Strategy]
    ) -> float:
        """Seconds to rebuild ``role``'s weights from layout ``src`` into layout ``dst``."""
        if src == dst:
            return 0.0
        key = ("realloc", role, src, dst)
        if key in self._cache:
            return self._cache[key]
        held = self._pieces(*src)
        # Any order of the destination ranks is a valid layout: order them by what they hold
        # so each replica of a piece sits on GPUs already holding parts of it (HybridFlow's
        # grouping; zero-redundancy when the meshes coincide).
        dmesh, ds = dst
        n_pieces = ds.tp * ds.pp
        order = sorted(dmesh.gpus, key=lambda g: (g not in held, held.get(g, (0, 0))[0], g))
        need = {
            g: (Fraction(j // ds.dp, n_pieces), Fraction(j // ds.dp + 1, n_pieces))
            for j, g in enumerate(order)
        }
        worst = Fraction(0)
        for g, (lo, hi) in need.items():
            have = held.get(g)
            got = Fraction(0)
            if have is not None:
                got = max(Fraction(0), min(hi, have[1]) - max(lo, have[0]))
            worst = max(worst, interval_length([(lo, hi)]) - got)
        bw = self._bw(set(src[0].gpus) | set(dst[0].gpus))
        t = float(worst) * self.models[role].weight_bytes / bw
        self._cache[key] = t
        return t

    def train_shape(self, role: str, s: Strategy, tokens: int | None = None) -> TrainShape:
        """One GPU's share of ``role``'s update under ``s`` (module docstring): micro-batches of
        ``tokens`` (default ``micro_batch_tokens``). The critic's head has one output: its
        logits term is ``T`` values, not ``T V``. The actor's lm_head runs on the ``gen + 1``
        last positions of a row (``logits_to_keep``) and its logprobs are chunked, as the
        trainer computes them (``relayrl.model.forward_logprobs``)."""
        m = self.models[role]
        tp = s.tp
        n = m.params / (tp * s.pp)
        actor = role != "critic"
        seq = self.prompt_len + self.gen_len
        return TrainShape(
            params=n,
            trainable=n,
            hidden=max(1, m.hidden // tp),
            layers=max(1, math.ceil(m.layers / s.pp)),
            vocab=1 if role == "critic" else max(1, m.vocab // tp),
            tokens=self.micro_batch_tokens if tokens is None else tokens,
            response_share=self.gen_len / (self.prompt_len + self.gen_len),
            bf16=True,
            dp=s.dp,
            optimizer="foreach",
            embedding_params=min(n, m.vocab * m.hidden / tp),
            logits_kept=min(1.0, (self.gen_len + 1) / seq) if actor else 1.0,
            chunked_logprobs=actor,
        )

    def train_memory(self, role: str, s: Strategy, tokens: int | None = None) -> float:
        """Bytes one GPU of ``role``'s training mesh holds for it at the peak of an update:
        ``memory_model.peak_bytes`` of :meth:`train_shape`."""
        return self.memory_model.peak_bytes(self.train_shape(role, s, tokens))

    def train_persistent(self, role: str, s: Strategy) -> float:
        """What stays between updates: ``memory_model.persistent_bytes`` (weights + AdamW)."""
        return self.memory_model.persistent_bytes(self.train_shape(role, s))

    def memory(self, plan: Plan) -> dict[int, float]:
        """Bytes needed on every GPU (persistent states + the largest transient)."""
        persist = [0.0] * self.n_gpus
        trans = [0.0] * self.n_gpus
        for role, home in _HOME.items():
            mesh, s = plan[home]
            n = self.models[role].params
            per = (
                self.train_persistent(role, s)
                if role in ("actor", "critic")
                else 2 * n / (s.tp * s.pp)
            )
            for g in mesh.gpus:
                persist[g] += per
        for call in CALLS:
            mesh, s = plan[call.name]
            m = self.models[call.role]
            x = 0.0
            if plan[_HOME[call.role]] != (mesh, s):
                x += m.weight_bytes / (s.tp * s.pp)
            if call.kind == "gen":
                b = math.ceil(self.batch / s.dp)
                x += b * (self.prompt_len + self.gen_len) * m.kv_bytes_per_token / (s.tp * s.pp)
            elif call.kind == "train":
                x += self.train_memory(call.role, s) - self.train_persistent(call.role, s)
            for g in mesh.gpus:
                trans[g] = max(trans[g], x)
        return {g: persist[g] + trans[g] for g in range(self.n_gpus)}

    def fits(self, plan: Plan) -> bool:
        cap = self.hardware.memory_bytes * self.memory_fraction
        return max(self.memory(plan).values()) <= cap

    def evaluate(self, plan: Plan, iterations: int = 2) -> PlanEval:
        """Simulated timeline of ``iterations`` iterations (see the module docstring)."""
        free = [0.0] * self.n_gpus
        done: dict[tuple[str, int], float] = {}
        spans: list[dict[str, Any]] = []
        realloc_total = 0.0
        for it in range(iterations):
            for call in CALLS:
                mesh, s = plan[call.name]
                ready = max((done[(d, it)] for d in _DEPS[call.name]), default=0.0)
                if it > 0 and call.name in _PREV:
                    ready = max(ready, done[(_PREV[call.name], it - 1)])
                start = max([ready, *(free[g] for g in mesh.gpus)])
                re = self.realloc_time(call.role, plan[_HOME[call.role]], (mesh, s))
                dur = re + self.call_time(call, mesh, s)
                end = start + dur
                for g in mesh.gpus:
                    free[g] = end
                done[(call.name, it)] = end
                realloc_total += re
                spans.append(
                    {
                        "call": call.name,
                        "iteration": it,
                        "mesh": str(mesh),
                        "strategy": str(s),
                        "start": start,
                        "end": end,
                        "realloc_s": re,
                    }
                )
        makespan = max(done.values())
        mem = self.memory(plan)
        cap = self.hardware.memory_bytes * self.memory_fraction
        busy = sum((sp["end"] - sp["start"]) * plan[sp["call"]][0].size for sp in spans)
        return PlanEval(
            plan=dict(plan),
            iteration_s=makespan / iterations,
            fits=max(mem.values()) <= cap,
            peak_memory_bytes=max(mem.values()),
            realloc_share=realloc_total / makespan if makespan else 0.0,
            gpu_busy_share=busy / (makespan * self.n_gpus) if makespan else 0.0,
            spans=spans,
        )


@dataclass
class PlanEval:
    plan: Plan
    iteration_s: float
    fits: bool
    peak_memory_bytes: float
    realloc_share: float
    gpu_busy_share: float
    spans: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration_s": round(self.iteration_s, 4),
            "fits": self.fits,
            "peak_memory_gb": round(self.peak_memory_bytes / 1e9, 2),
            "realloc_share": round(self.realloc_share, 4),
            "gpu_busy_share": round(self.gpu_busy_share, 4),
            "calls": {c: {"mesh": str(m), "dp_tp_pp": str(s)} for c, (m, s) in self.plan.items()},
        }


def heuristic_plan(pb: PPOProblem) -> Plan:
    """Every call on all GPUs, tensor parallel inside a node, pipeline across nodes."""
    mesh = Mesh(0, pb.n_gpus)
    s = Strategy(1, pb.gpn, pb.n_nodes)
    return {c.name: (mesh, s) for c in CALLS}


def symmetric_plan(pb: PPOProblem) -> Plan:
    """Every call on all GPUs with one layout: tensor parallel in a node, data parallel across."""
    mesh = Mesh(0, pb.n_gpus)
    s = Strategy(pb.n_nodes, pb.gpn, 1)
    return {c.name: (mesh, s) for c in CALLS}


def asymmetric_plan(pb: PPOProblem) -> Plan:
    """OpenRLHF-like disjoint meshes: generation and actor training get 3/8 of the GPUs
    each, the critic 1/8, reference and reward 1/16 each (at least one GPU each; tensor
    parallel up to a node)."""
    n = pb.n_gpus
    sizes = {
        "gen": max(1, 3 * n // 8),
        "actor": max(1, 3 * n // 8),
        "critic": max(1, n // 8),
        "ref": max(1, n // 16),
        "reward": max(1, n // 16),
    }
    if sum(sizes.values()) > n:
        raise ValueError(
            "an asymmetric plan (3/8 generation, 3/8 actor, 1/8 critic, 1/16 ref, 1/16 reward, "
            f"at least one GPU each: {'+'.join(str(v) for v in sizes.values())}) needs "
            f"{sum(sizes.values())} GPUs, the cluster has {n}"
        )
    start = 0
    out: Plan = {}
    for key, calls in (
        ("gen", ["actor_gen"]),
        ("actor", ["actor_train"]),
        ("critic", ["critic_inf", "critic_train"]),
        ("ref", ["ref_inf"]),
        ("reward", ["reward_inf"]),
    ):
        size = sizes[key]
        tp = min(size, pb.gpn)
        mesh = Mesh(start, size)
        for c in calls:
            out[c] = (mesh, Strategy(size // tp, tp, 1))
        start += size
    return out


def _cost(pb: PPOProblem, plan: Plan, penalty: float) -> tuple[float, bool]:
    ev_t = pb.evaluate(plan).iteration_s
    mem = max(pb.memory(plan).values())
    cap = pb.hardware.memory_bytes * pb.memory_fraction
    if mem <= cap:
        return ev_t, True
    return ev_t * penalty * (mem / cap), False


def greedy_plan(pb: PPOProblem, start: Plan | None = None, passes: int = 2) -> Plan:
    """Coordinate descent: call by call, the (mesh, strategy) that lowers the cost most."""
    plan = dict(start or heuristic_plan(pb))
    best, _ = _cost(pb, plan, 1e3)
    for _ in range(passes):
        improved = False
        for call in CALLS:
            for opt in pb.options(call):
                trial = dict(plan)
                trial[call.name] = opt
                c, _ = _cost(pb, trial, 1e3)
                if c < best - 1e-12:
                    best, plan, improved = c, trial, True
        if not improved:
            break
    return plan


def search_plan(
    pb: PPOProblem,
    steps: int = 4000,
    seed: int = 0,
    t0: float = 0.05,
    t_end: float = 1e-4,
    penalty: float = 1e3,
    start: Plan | None = None,
) -> PlanEval:
    """Simulated annealing over plans; returns the best plan that passes the memory check.

    Raises ``ValueError`` when no plan seen fits in memory.
    """
    if steps < 0:
        raise ValueError("steps must be >= 0")
    rng = random.Random(seed)
    if start is None:  # the cheaper of the greedy descents from the two all-GPU baselines
        starts = [greedy_plan(pb, heuristic_plan(pb)), greedy_plan(pb, symmetric_plan(pb))]
        cur = min(starts, key=lambda p: _cost(pb, p, penalty)[0])
    else:
        cur = greedy_plan(pb, start)
    cur_c, cur_ok = _cost(pb, cur, penalty)
    best, best_c = (dict(cur), cur_c) if cur_ok else (None, math.inf)
    scale = cur_c if cur_ok else _cost(pb, cur, 1.0)[0]
    for k in range(steps):
        temp = scale * t0 * (t_end / t0) ** (k / max(1, steps - 1))
        call = CALLS[rng.randrange(len(CALLS))]
        opts = pb.options(call)
        trial = dict(cur)
        trial[call.name] = opts[rng.randrange(len(opts))]
        c, ok = _cost(pb, trial, penalty)
        if c <= cur_c or rng.random() < math.exp(-(c - cur_c) / temp):
            cur, cur_c = trial, c
            if ok and c < best_c:
                best, best_c = dict(trial), c
    if best is None:
        raise ValueError("no execution plan fits in device memory; add devices")
    ev = pb.evaluate(best)
    assert ev.fits
    return ev

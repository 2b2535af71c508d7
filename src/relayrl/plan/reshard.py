"""Train <-> generate resharding calculator (HybridFlow's 3D-HybridEngine, and its rivals).

The model's parameters are the interval ``[0, 1)`` (fractions of the model size ``M``, exact
rationals). A training layout ``p-t-d`` (pipeline, tensor, data parallel; ``N = p*t*d``
GPUs) cuts it into ``p*t`` equal pieces: training rank ``g = d_idx*(p*t) + m`` with
``m = pp_idx*t + tp_idx`` holds piece ``m``. A generation layout ``p_g-t_g`` cuts it into
``p_g*t_g`` pieces and forms, inside every training model-parallel group, a micro data
parallel of size ``d_g = p*t / (p_g*t_g)``.

Strategies (what each GPU *holds* for training, *needs* for generation, *receives*):

* ``hybridflow`` - HybridFlow's grouping: micro-DP groups are consecutive ranks, generation
  model-parallel groups are strided by ``d_g`` (8 GPUs, 1-4-2 -> 1-2-2-2: generation TP
  groups [G1,G3], [G2,G4], micro-DP groups [G1,G2], [G3,G4]). Rank ``m`` needs piece
  ``m // d_g`` of ``p_g*t_g``, which *contains* its training piece, so it receives only the
  rest from its micro-DP peers:
  ``comm = (t*p - t_g*p_g) / (t_g*p_g*t*p) M``, ``peak = M / (t_g*p_g)``, ``redundancy = 0``.
* ``hybridflow-v`` - contiguous grouping (generation TP groups [G1,G2], [G3,G4], ...): rank
  ``m`` needs piece ``m mod (p_g*t_g)``, often disjoint from its training piece. As in the
  HybridFlow paper it all-gathers the training model-parallel group and keeps its piece:
  ``comm = (t*p - 1)/(t*p) M``, ``peak = M``, ``redundancy <= M/(t*p)`` (the training piece it
  must keep for the next training step; 0 on a GPU whose generation piece covers it).
* ``deepspeed-chat`` - ZeRO-3 training shards over all ``N`` GPUs, all-gather over all of
  them: ``comm = (N - 1)/N M``, ``peak = M``, ``redundancy <= M/N``.
* ``separate`` - OpenRLHF: generation runs on its own GPUs (``gen_replicas`` copies of the
  ``p_g-t_g`` layout); every generation GPU receives its whole piece
  ``M/(p_g*t_g)``; the cluster holds ``1 + gen_replicas`` copies of the weights. The
  transition time is the whole model over the effective trainer->generator bandwidth,
  ``M / BW`` (70B: 140 GB at 25 GB/s = 5.6 s).

For the colocated strategies the transition time is the largest per-GPU receive over the
per-GPU bandwidth (all GPUs receive in parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

__all__ = [
    "STRATEGIES",
    "GpuReshard",
    "ReshardPlan",
    "compare_strategies",
    "interval_length",
    "reshard",
    "transfer_share",
    "weight_transfer_time",
]

Strategy = Literal["hybridflow", "hybridflow-v", "deepspeed-chat", "separate"]
STRATEGIES: tuple[str, ...] = ("hybridflow", "hybridflow-v", "deepspeed-chat", "separate")
Interval = tuple[Fraction, Fraction]


def _piece(i: int, n: int) -> list[Interval]:
    return [(Fraction(i, n), Fraction(i + 1, n))]


def _normalise(ivs: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(iv for iv in ivs if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for lo, hi in _normalise(a):
        cur = [(lo, hi)]
        for blo, bhi in _normalise(b):
            nxt = []
            for clo, chi in cur:
                if bhi <= clo or blo >= chi:
                    nxt.append((clo, chi))
                    continue
                if blo > clo:
                    nxt.append((clo, blo))
                if bhi < chi:
                    nxt.append((bhi, chi))
            cur = nxt
        out.extend(cur)
    return _normalise(out)


def interval_length(ivs: list[Interval]) -> Fraction:
    """Total length of a union of intervals (a fraction of the model)."""
    return sum((b - a for a, b in _normalise(ivs)), Fraction(0))


@dataclass
class GpuReshard:
    """One GPU's view of the transition (sizes are fractions of the model size ``M``)."""

    gpu: int
    role: str
    holds: list[Interval]
    needs: list[Interval]
    receives: list[Interval]
    peak: Fraction
    redundant: Fraction
    gen_group: list[int] = field(default_factory=list)
    micro_dp_group: list[int] = field(default_factory=list)

    @property
    def receive(self) -> Fraction:
        """Communication volume of this GPU (fraction of ``M``)."""
        return interval_length(self.receives)

    @property
    def missing(self) -> Fraction:
        """What it needs but does not hold: ``|needs - holds|`` (a lower bound on receive)."""
        return interval_length(_minus(self.needs, self.holds))

    def to_dict(self, model_bytes: float | None = None) -> dict[str, Any]:
        def fmt(ivs: list[Interval]) -> list[str]:
            return [f"[{a}, {b})" for a, b in ivs]

        d: dict[str, Any] = {
            "gpu": self.gpu,
            "role": self.role,
            "holds": fmt(self.holds),
            "needs": fmt(self.needs),
            "receives": fmt(self.receives),
            "receive": str(self.receive),
            "missing": str(self.missing),
            "peak": str(self.peak),
            "redundant": str(self.redundant),
            "gen_group": self.gen_group,
            "micro_dp_group": self.micro_dp_group,
        }
        if model_bytes is not None:
            d["receive_gb"] = float(self.receive) * model_bytes / 1e9
            d["peak_gb"] = float(self.peak) * model_bytes / 1e9
            d["redundant_gb"] = float(self.redundant) * model_bytes / 1e9
        return d


@dataclass
class ReshardPlan:
    """Per-GPU transition of one strategy, with totals and the paper's closed forms."""

    strategy: str
    train: tuple[int, int, int]
    gen: tuple[int, int]
    d_g: int
    gpus: list[GpuReshard]
    formula: dict[str, Fraction]
    model_bytes: float | None = None
    bandwidth: float | None = None

    @property
    def max_receive(self) -> Fraction:
        """Largest per-GPU communication volume (fraction of ``M``)."""
        return max(g.receive for g in self.gpus)

    @property
    def total_receive(self) -> Fraction:
        return sum((g.receive for g in self.gpus), Fraction(0))

    @property
    def peak(self) -> Fraction:
        return max(g.peak for g in self.gpus)

    @property
    def redundant(self) -> Fraction:
        return max(g.redundant for g in self.gpus)

    def gb(self, frac: Fraction) -> float:
        """A fraction of the model in GB (needs ``model_bytes``)."""
        if self.model_bytes is None:
            raise ValueError("model size unknown: pass model_bytes")
        return float(frac) * self.model_bytes / 1e9

    def transition_time(self) -> float:
        """Seconds: ``M / BW`` for ``separate``, else ``max per-GPU receive / BW``."""
        if self.model_bytes is None or not self.bandwidth:
            raise ValueError("transition time needs model_bytes and bandwidth")
        if self.strategy == "separate":
            return weight_transfer_time(self.model_bytes, self.bandwidth)
        return float(self.max_receive) * self.model_bytes / self.bandwidth

    def summary(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "strategy": self.strategy,
            "train_pxtxd": "-".join(map(str, self.train)),
            "gen_pgxtg": "-".join(map(str, self.gen)),
            "d_g": self.d_g,
            "comm": str(self.max_receive),
            "peak": str(self.peak),
            "redundant": str(self.redundant),
            "formula_comm": str(self.formula["comm"]),
            "formula_peak": str(self.formula["peak"]),
            "formula_redundant": str(self.formula["redundant"]),
        }
        if self.model_bytes is not None:
            d["comm_gb"] = round(self.gb(self.max_receive), 4)
            d["peak_gb"] = round(self.gb(self.peak), 4)
            d["redundant_gb"] = round(self.gb(self.redundant), 4)
            if self.bandwidth:
                d["transition_s"] = round(self.transition_time(), 4)
        return d


MAX_RESHARD_GPUS = 4096
"""Largest training layout (``p * t * d`` GPUs) :func:`reshard` computes exactly (seconds)."""


def _check_layouts(train: tuple[int, int, int], gen: tuple[int, int]) -> int:
    if len(train) != 3 or len(gen) != 2:
        raise ValueError("training layout is (p, t, d) and generation layout is (p_g, t_g)")
    if min(train) < 1 or min(gen) < 1:
        raise ValueError("parallel sizes must be >= 1")
    p, t, d = train
    if p * t * d > MAX_RESHARD_GPUS:
        raise ValueError(
            f"training layout {p}-{t}-{d} is {p * t * d} GPUs; the exact per-GPU intervals are "
            f"computed for at most {MAX_RESHARD_GPUS} GPUs"
        )
    pg, tg = gen
    if (p * t) % (pg * tg):
        raise ValueError(
            f"p*t = {p * t} is not a multiple of p_g*t_g = {pg * tg}: no micro data parallel fits"
        )
    return (p * t) // (pg * tg)


def reshard(
    train: tuple[int, int, int],
    gen: tuple[int, int],
    strategy: str = "hybridflow",
    model_bytes: float | None = None,
    bandwidth: float | None = None,
    gen_replicas: int | None = None,
) -> ReshardPlan:
    """Exact per-GPU intervals for one strategy (see the module docstring).

    Args:
        train: ``(p, t, d)`` training layout.
        gen: ``(p_g, t_g)`` generation layout (``d_g = p*t / (p_g*t_g)``).
        strategy: one of :data:`STRATEGIES`.
        model_bytes: ``M`` in bytes (e.g. 140e9 for 70B in bf16) to report GB and seconds.
        bandwidth: bytes/s per GPU (colocated) or trainer->generator (``separate``).
        gen_replicas: generation replicas for ``separate`` (default ``d * d_g``, as many GPUs
            as training).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    d_g = _check_layouts(train, gen)
    p, t, d = train
    pg, tg = gen
    mp, gmp, n = p * t, pg * tg, p * t * d
    full: list[Interval] = [(Fraction(0), Fraction(1))]
    gpus: list[GpuReshard] = []
    if strategy == "separate":
        reps = gen_replicas if gen_replicas is not None else d * d_g
        if reps < 1:
            raise ValueError("gen_replicas must be >= 1")
        for g in range(n):
            m = g % mp
            gpus.append(GpuReshard(g, "train", _piece(m, mp), [], [], Fraction(1, mp), Fraction(0)))
        for r in range(reps):
            group = [n + r * gmp + k for k in range(gmp)]
            for k in range(gmp):
                need = _piece(k, gmp)
                gpus.append(
                    GpuReshard(
                        n + r * gmp + k,
                        "generate",
                        [],
                        need,
                        need,
                        Fraction(1, gmp),
                        Fraction(0),
                        group,
                    )
                )
        formula = {"comm": Fraction(1, gmp), "peak": Fraction(1, gmp), "redundant": Fraction(0)}
        plan = ReshardPlan(strategy, train, gen, d_g, gpus, formula, model_bytes, bandwidth)
        return plan
    for g in range(n):
        base, m = divmod(g, mp)
        base *= mp
        if strategy == "hybridflow":
            k, r = divmod(m, d_g)
            holds = _piece(m, mp)
            needs = _piece(k, gmp)
            gen_group = [base + kk * d_g + r for kk in range(gmp)]
            mdp = [base + k * d_g + rr for rr in range(d_g)]
            receives = _minus(needs, holds)
            peak = interval_length(holds + needs)
        else:
            r, k = divmod(m, gmp)
            if strategy == "deepspeed-chat":
                holds = _piece(g, n)
                receives = _minus(full, holds)
            else:
                holds = _piece(m, mp)
                receives = _minus(full, holds)
            needs = _piece(k, gmp)
            gen_group = [base + r * gmp + kk for kk in range(gmp)]
            mdp = [base + rr * gmp + k for rr in range(d_g)]
            peak = Fraction(1)  # the all-gathered model is resident at once
        redundant = interval_length(_minus(holds, needs))
        gpus.append(
            GpuReshard(g, "colocated", holds, needs, receives, peak, redundant, gen_group, mdp)
        )
    if strategy == "hybridflow":
        formula = {
            "comm": Fraction(mp - gmp, gmp * mp),
            "peak": Fraction(1, gmp),
            "redundant": Fraction(0),
        }
    elif strategy == "hybridflow-v":
        formula = {"comm": Fraction(mp - 1, mp), "peak": Fraction(1), "redundant": Fraction(1, mp)}
    else:
        formula = {"comm": Fraction(n - 1, n), "peak": Fraction(1), "redundant": Fraction(1, n)}
    return ReshardPlan(strategy, train, gen, d_g, gpus, formula, model_bytes, bandwidth)


def compare_strategies(
    train: tuple[int, int, int],
    gen: tuple[int, int],
    model_bytes: float | None = None,
    bandwidth: float | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
) -> list[ReshardPlan]:
    """:func:`reshard` for several strategies on the same layouts."""
    return [reshard(train, gen, s, model_bytes, bandwidth) for s in strategies]


def weight_transfer_time(model_bytes: float, bandwidth: float) -> float:
    """Seconds to move ``model_bytes`` at ``bandwidth`` bytes/s: ``M / BW``.

    70B in bf16 (140 GB): 5.6 s at 25 GB/s, 2.8 s at 50 GB/s.
    """
    if model_bytes < 0 or bandwidth <= 0:
        raise ValueError("model_bytes must be >= 0 and bandwidth > 0")
    return model_bytes / bandwidth


def transfer_share(transfer_s: float, rest_s: float) -> float:
    """Share of an iteration spent moving weights: ``transfer / (transfer + rest)``.

    2.8 s of transfer on a 20 s iteration: 2.8 / 22.8 = 12.3%.
    """
    if transfer_s < 0 or rest_s < 0 or transfer_s + rest_s == 0:
        raise ValueError("times must be >= 0 and not both 0")
    return transfer_s / (transfer_s + rest_s)

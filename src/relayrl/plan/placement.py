"""Placement of the four RLHF models on device groups, and device-count search.

A *placement* groups {actor, critic, ref, reward} into device groups; models in one group are
colocated and time-share its devices, different groups run concurrently. The placements are
the set partitions of the four roles: Bell number ``B_4 = 15``. Three have names:
``colocate`` (one group: DeepSpeed-Chat, veRL's default), ``nemo`` ({actor, ref} |
{critic, reward}: NeMo-Aligner), ``separate`` (four groups: OpenRLHF).

Cost model of one PPO iteration for a placement with ``G_j`` devices in group ``j``
(HybridFlow's Algorithm 1 enumerates the same space with a simulator; this one is simple on
purpose):

    t_gen   = generate_s of the schedule simulator's sync run of one step (the same model
              ``relayrl simulate`` uses): B answers on G_a devices, c per device at most
    t_prep  = max_j  sum_{m in j, m in {ref, reward, critic}} 2 N_m T / (G_j P mfu)
    t_train = max_j  sum_{m in j, m in {actor, critic}} (6 N_m T / (G_j P mfu) + t_ar(m, G_j))
    t_iter  = t_gen + t_prep + t_train

``B`` responses of mean length ``L_mean`` (a length distribution, or ``B - 1`` answers of
``L_mean`` and one of ``L_max``), ``T = B (prompt + L_mean)`` tokens, ``c`` sequences decoded
per actor device (the roofline time model,
:class:`~relayrl.plan.timemodel.RooflineTimeModel`, on the smallest tensor-parallel group
the actor's weights fit), ``t_ar`` the ring all-reduce of
bf16 gradients ``2 (G-1)/G * 2 N / BW`` (NVLink inside a node, the network across nodes): a
cost that does not shrink with more devices, which is what makes colocating everything stop
scaling on large clusters. The generation term has a floor: the longest answer decodes
step by step whatever the device count (the simulator's continuous batching shows it).
Memory per device of a group:
``sum_m (16 if trained else 2) * N_m / G_j`` (weights, gradients, Adam; activations and KV
left out) must fit ``memory_fraction`` of the device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from relayrl.plan.hardware import HardwareSpec
from relayrl.plan.lengths import ConstantLengths, FixedLengths, LengthDist
from relayrl.plan.models import ModelSpec
from relayrl.plan.timemodel import RooflineTimeModel

__all__ = [
    "NAMED_PLACEMENTS",
    "ROLES",
    "TRAINED_ROLES",
    "PlacementResult",
    "RLHFWorkload",
    "allocations",
    "models_memory_bytes",
    "placement_memory",
    "search_placements",
    "set_partitions",
]

ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward")
TRAINED_ROLES = frozenset({"actor", "critic"})
Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: tuple[str, ...] | list[str]) -> list[Placement]:
    """All set partitions of ``items`` (each block in input order), Bell(n) of them."""
    items = tuple(items)
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out: list[Placement] = []
    for part in set_partitions(rest):
        out.append(((first,), *part))
        for i in range(len(part)):
            out.append(part[:i] + ((first, *part[i]),) + part[i + 1 :])
    return sorted(out, key=lambda p: (len(p), p))


NAMED_PLACEMENTS: dict[str, Placement] = {
    "colocate": (("actor", "critic", "ref", "reward"),),
    "nemo": (("actor", "ref"), ("critic", "reward")),
    "separate": (("actor",), ("critic",), ("ref",), ("reward",)),
}


def placement_name(p: Placement) -> str:
    for k, v in NAMED_PLACEMENTS.items():
        if sorted(map(sorted, v)) == sorted(map(sorted, p)):
            return k
    return " | ".join("+".join(g) for g in p)


def models_memory_bytes(
    models: dict[str, ModelSpec], trained: set[str] | frozenset[str] = TRAINED_ROLES
) -> float:
    """``sum_m (16 if m trained else 2) * N_m`` bytes.

    Four 7B models (actor and critic trained): 7e9 * (16 + 16 + 2 + 2) = 252 GB; four 70B
    models: 2520 GB.
    """
    return sum(m.memory_bytes(role in trained) for role, m in models.items())


def placement_memory(placement: Placement, models: dict[str, ModelSpec]) -> list[float]:
    """Bytes each group of ``placement`` must hold (divide by its device count per device)."""
    return [models_memory_bytes({r: models[r] for r in group}) for group in placement]


@dataclass
class RLHFWorkload:
    """One PPO iteration: models, hardware and batch.

    Attributes:
        models: role -> spec for ``actor``, ``critic``, ``ref``, ``reward``.
        hardware: device spec.
        batch: responses per iteration ``B``.
        prompt_len: prompt tokens.
        mean_len: mean response tokens ``L_mean``.
        max_len: longest response ``L_max`` (default ``mean_len``: no tail).
        gen_per_device: decode concurrency per actor device ``c``.
        mfu: model-FLOPs utilisation of forward/backward passes.
        decode_efficiency: fraction of HBM bandwidth in decoding.
        memory_fraction: usable share of device memory.
        lengths: response-length distribution for the generation time (default: ``B - 1``
            answers of ``mean_len`` and one of ``max_len``, or all ``mean_len``).
    """

    models: dict[str, ModelSpec]
    hardware: HardwareSpec
    batch: int = 1024
    prompt_len: int = 256
    mean_len: int = 1024
    max_len: int | None = None
    gen_per_device: int = 64
    mfu: float = 0.4
    decode_efficiency: float = 0.6
    memory_fraction: float = 0.9
    lengths: LengthDist | None = None
    _gen_cache: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        missing = set(ROLES) - set(self.models)
        if missing:
            raise ValueError(f"workload lacks models for {', '.join(sorted(missing))}")
        if self.batch < 1 or self.mean_len < 1 or self.gen_per_device < 1:
            raise ValueError("batch, mean_len and gen_per_device must be >= 1")

    @property
    def tokens(self) -> float:
        return self.batch * (self.prompt_len + self.mean_len)

    def gen_time(self, devices: int) -> float:
        """Seconds to generate the batch on ``devices`` actor devices: the simulator's sync
        generation (``SimResult.breakdown["generate_s"]``), ``inf`` when the actor's weights
        fit no tensor-parallel group of them."""
        if devices not in self._gen_cache:
            self._gen_cache[devices] = self._simulate_gen(devices)
        return self._gen_cache[devices]

    def _simulate_gen(self, devices: int) -> float:
        from relayrl.plan.simulator import SimConfig, simulate

        actor = self.models["actor"]
        tm = RooflineTimeModel(
            actor,
            self.hardware,
            self.decode_efficiency,
            self.mfu,
            kv_memory_fraction=self.memory_fraction,
            max_batch_per_device=self.gen_per_device,
        )
        if self.lengths is not None:
            lengths: LengthDist = self.lengths
        elif self.max_len is not None and self.max_len != self.mean_len:
            lengths = FixedLengths([self.max_len] + [self.mean_len] * (self.batch - 1))
        else:
            lengths = ConstantLengths(self.mean_len)
        max_ctx = self.prompt_len + int(lengths.cap)
        for tp in (g for g in range(1, devices + 1) if devices % g == 0):
            try:
                tm.max_concurrency(tp, max_ctx)
            except ValueError:
                continue
            cfg = SimConfig(
                tm,
                lengths,
                schedule="sync",
                n_devices=devices,
                gen_devices_per_replica=tp,
                batch_size=self.batch,
                n_steps=1,
                prompt_len=self.prompt_len,
                check_memory=False,
            )
            return simulate(cfg).breakdown["generate_s"]
        return math.inf

    def allreduce_time(self, role: str, devices: int) -> float:
        if devices <= 1:
            return 0.0
        bw = (
            self.hardware.intra_node_bandwidth
            if devices <= self.hardware.gpus_per_node
            else self.hardware.inter_node_bandwidth
        )
        return 2 * (devices - 1) / devices * self.models[role].weight_bytes / bw

    def fwd_time(self, role: str, devices: int) -> float:
        n = self.models[role].params
        return 2 * n * self.tokens / (devices * self.hardware.peak_flops * self.mfu)

    def train_time(self, role: str, devices: int) -> float:
        n = self.models[role].params
        t = 6 * n * self.tokens / (devices * self.hardware.peak_flops * self.mfu)
        return t + self.allreduce_time(role, devices)


@dataclass
class PlacementResult:
    placement: Placement
    devices: tuple[int, ...]
    iteration_s: float
    breakdown: dict[str, float]
    memory_per_device: tuple[float, ...]
    fits: bool
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = placement_name(self.placement)

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.name,
            "groups": ["+".join(g) for g in self.placement],
            "devices": list(self.devices),
            "iteration_s": round(self.iteration_s, 4),
            **{k: round(v, 4) for k, v in self.breakdown.items()},
            "memory_per_device_gb": [round(m / 1e9, 2) for m in self.memory_per_device],
            "fits": self.fits,
        }


def evaluate_placement(
    placement: Placement, devices: tuple[int, ...], w: RLHFWorkload
) -> PlacementResult:
    """Iteration time and memory of ``placement`` with ``devices[j]`` devices for group ``j``."""
    if len(devices) != len(placement) or min(devices) < 1:
        raise ValueError("one positive device count per group is required")
    group_of = {r: j for j, g in enumerate(placement) for r in g}
    t_gen = w.gen_time(devices[group_of["actor"]])
    prep = [0.0] * len(placement)
    train = [0.0] * len(placement)
    for role in ("ref", "reward", "critic"):
        j = group_of[role]
        prep[j] += w.fwd_time(role, devices[j])
    for role in ("actor", "critic"):
        j = group_of[role]
        train[j] += w.train_time(role, devices[j])
    mem = tuple(b / g for b, g in zip(placement_memory(placement, w.models), devices, strict=True))
    fits = max(mem) <= w.hardware.memory_bytes * w.memory_fraction
    br = {"generate_s": t_gen, "prepare_s": max(prep), "train_s": max(train)}
    return PlacementResult(placement, tuple(devices), sum(br.values()), br, mem, fits)


def allocations(n_devices: int, groups: int, unit: int = 1) -> list[tuple[int, ...]]:
    """All ways to give each of ``groups`` groups a positive multiple of ``unit`` devices,
    summing to ``n_devices`` (compositions)."""
    if n_devices % unit:
        raise ValueError(f"{n_devices} devices are not a multiple of the unit {unit}")
    k = n_devices // unit
    if groups > k:
        return []
    out = []
    for cuts in itertools.combinations(range(1, k), groups - 1):
        parts = [b - a for a, b in zip((0, *cuts), (*cuts, k), strict=True)]
        out.append(tuple(p * unit for p in parts))
    return out


def search_placements(
    w: RLHFWorkload,
    n_devices: int,
    unit: int | None = None,
    placements: list[Placement] | None = None,
) -> list[PlacementResult]:
    """Best device split for each placement, ranked by iteration time (fitting ones first).

    ``unit``: devices are assigned in multiples of it (default 1 up to 16 devices, else the
    node size).
    """
    if n_devices < 1:
        raise ValueError("n_devices must be >= 1")
    if unit is None:
        unit = 1 if n_devices <= 16 else w.hardware.gpus_per_node
    best: list[PlacementResult] = []
    for pl in placements or set_partitions(ROLES):
        cands = [evaluate_placement(pl, a, w) for a in allocations(n_devices, len(pl), unit)]
        if not cands:
            continue
        cands.sort(key=lambda r: (not r.fits, r.iteration_s))
        best.append(cands[0])
    best.sort(key=lambda r: (not r.fits, r.iteration_s))
    return best

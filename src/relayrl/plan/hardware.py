"""Accelerator specifications used by the roofline time model.

All figures are dense BF16 (no 2:4 sparsity), SXM parts, from the vendors' datasheets:

========  ===============  ==============  ======  ====================  ===================
name      peak FLOP/s      HBM B/s         HBM     NVLink B/s (one way)  network B/s per GPU
========  ===============  ==============  ======  ====================  ===================
a100      312e12           2.039e12        80 GB   300e9                 25e9 (200 Gb/s)
h100      989e12           3.35e12         80 GB   450e9                 50e9 (400 Gb/s)
h200      989e12           4.8e12          141 GB  450e9                 50e9 (400 Gb/s)
h800      989e12           3.35e12         80 GB   200e9                 50e9 (400 Gb/s)
========  ===============  ==============  ======  ====================  ===================

The *ridge point* ``peak / bandwidth`` (FLOP per byte) separates memory-bound from
compute-bound work: about 153 for the A100 (the lecture rounds the bandwidth to 2 TB/s and
quotes 156), 295 for the H100. Decoding a batch of ``b`` sequences has an arithmetic intensity
of about ``b`` FLOP per weight byte (2 FLOP per parameter per token, 2 bytes per parameter),
so it stays memory-bound until ``b`` reaches the ridge point.

``h200-measured`` is the H200 as relayrl measured it (``tools/device_run.py``; the run's JSON
is ``docs/gpu-runs/2026-12-04-figures-alone.json``, ``docs/gpu.md`` says how): the ceilings are
the measured ones (an 8192^3 bf16 matmul on random data; a 4 GiB device-to-device copy,
read + write), and :data:`MEASURED` holds the efficiencies relayrl reached there, which the
planner's CLI uses as its ``--mfu`` default and decode step overhead when this hardware is
named.

A CPU has no entry here: its speed is *measured* on the user's machine with
:func:`relayrl.plan.profiling.profile` and used through
:class:`relayrl.plan.timemodel.ProfiledTimeModel`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["HARDWARE", "MEASURED", "HardwareSpec", "MeasuredEfficiency", "get_hardware"]

GB = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator.

    Attributes:
        name: short name (``h100``).
        peak_flops: dense BF16 peak, FLOP/s.
        mem_bandwidth: HBM bandwidth, bytes/s.
        memory_bytes: HBM capacity, bytes.
        intra_node_bandwidth: NVLink bandwidth one way per GPU, bytes/s.
        inter_node_bandwidth: network bandwidth per GPU between nodes, bytes/s.
        gpus_per_node: GPUs in one node.
        price_per_hour: default rental price, USD per GPU-hour (override freely).
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int = 8
    price_per_hour: float = 2.0

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where compute and memory time are equal."""
        return self.peak_flops / self.mem_bandwidth

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


HARDWARE: dict[str, HardwareSpec] = {
    "a100": HardwareSpec("a100", 312e12, 2.039e12, 80 * GB, 300e9, 25e9, 8, 1.8),
    "h100": HardwareSpec("h100", 989e12, 3.35e12, 80 * GB, 450e9, 50e9, 8, 2.5),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 141 * GB, 450e9, 50e9, 8, 3.5),
    "h800": HardwareSpec("h800", 989e12, 3.35e12, 80 * GB, 200e9, 50e9, 8, 2.5),
    # measured on one H200 (docs/gpu-runs/2026-12-04-figures-alone.json): matmul, copy
    "h200-measured": HardwareSpec(
        "h200-measured", 791.7e12, 4.27e12, 141 * GB, 450e9, 50e9, 8, 3.5
    ),
}


@dataclass(frozen=True)
class MeasuredEfficiency:
    """What relayrl reached on a measured part (fractions of its *measured* ceilings).

    Attributes:
        mfu: actor update, ``6 N tokens/s / peak`` (Qwen2-1.5B shape, bf16, no checkpointing).
        decode_step_overhead_s: seconds per decode step that do not scale with the batch
            (the own engine's step at 1 row with CUDA graphs, Qwen2-0.5B shape: kernel
            launches and host work). The planner adds it to every decode step; the bandwidth
            part keeps ``--decode-eff``.
        roofline_fraction: own-engine decode at 256 rows (CUDA graphs), tokens/s over the HBM
            roofline ``rows * bandwidth / (weight bytes + KV bytes read per step)`` (reported).
        weight_load_s_per_gb: loading new weights into a colocated engine, seconds per GB.
        source: the run's JSON with the ceilings and the update figures.
        decode_source: the run's JSON with the decode figures.
    """

    mfu: float
    decode_step_overhead_s: float
    roofline_fraction: float
    weight_load_s_per_gb: float
    source: str
    decode_source: str


MEASURED: dict[str, MeasuredEfficiency] = {
    "h200-measured": MeasuredEfficiency(
        mfu=0.3247,
        decode_step_overhead_s=1 / 278.5,
        roofline_fraction=0.06676,
        weight_load_s_per_gb=0.006039,
        source="docs/gpu-runs/2026-12-04-figures-alone.json",
        decode_source="docs/gpu-runs/2026-12-04-cuda-graphs.json",
    ),
}


def get_hardware(name: str) -> HardwareSpec:
    """Look up a spec by name (case-insensitive; ``A100-80GB`` and ``h100-sxm`` work too)."""
    full = name.strip().lower()
    if full in HARDWARE:
        return HARDWARE[full]
    key = full.split("-")[0]
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}")
    return HARDWARE[key]

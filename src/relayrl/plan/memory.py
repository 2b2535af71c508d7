"""Training memory of one trainer rank, calibrated on ``bench/scale.py`` measurements.

What is modelled is the memory an actor update adds on top of the loaded weights (the bench's
``train_peak_mb`` = peak RSS minus the RSS after loading), for ``N`` parameters of which
``N_t`` train, micro-batches of ``T`` tokens, hidden size ``h`` and ``L`` layers:

    train = fixed + slope * T

    fixed = (p_t * N_t + p_all * N + [bf16] p_bf16 * N + [ckpt] p_ckpt * N_t)
            * [FSDP over dp ranks] (1 / dp + o_fsdp)
    slope = h * L * (a + [bf16] d_bf16 + [ckpt] d_ckpt + [LoRA] d_lora + [FSDP] d_fsdp)

``p_*`` are bytes per parameter (``p_t``: gradient + AdamW m, v + the optimizer's temporaries
of a trained parameter, 12 + temporaries in fp32; ``p_all``: what every parameter costs in an
update whether it trains or not; ``p_bf16``: the bf16 weight copies autocast keeps;
``p_ckpt``: what checkpointing changes in the fixed part), ``a`` is the growth of the peak per
token, hidden unit and layer, and the ``d_*`` are what each feature adds to it (additive, not
ratios: the fp32 peak of the bench is set by the optimizer step, not by the activations, so
its slope is near 0 and a ratio to it would be meaningless). Both parts are clamped at 0.

Calibration (:func:`fit`): the bench run at two micro-batch sizes ``T1 < T2`` gives, per
configuration, the line through its two points: ``slope = (m2 - m1) / (T2 - T1)`` and
``fixed = m1 - slope * T1``. Then ``a = slope_fp32 / (h L)``; ``p_t`` and ``p_all`` solve
``fixed_fp32 = (p_t + p_all) N`` and ``fixed_lora = p_t N_t^lora + p_all N`` (two equations,
two unknowns); ``p_bf16 = (fixed_bf16 - fixed_fp32) / N``; ``p_ckpt = (fixed_ckpt -
fixed_fp32) / N``; ``o_fsdp = fixed_fsdp / fixed_fp32 - 1/2`` (dp = 2), and each ``d`` is the
configuration's slope minus the fp32 slope, over ``h L``. A configuration the bench did not
measure (bf16 + checkpointing, FSDP2 over 8 ranks) combines the terms: an extrapolation.

The constants of :data:`CALIBRATED` are this fit on the 50M-parameter Llama of
``docs/scale.md`` on a 2-core CPU (RSS, fp32 allocator, gloo): on a GPU the caching allocator
and NCCL buffers differ, so they are a CPU calibration until the GPU check measures them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

MB = float(2**20)


@dataclass(frozen=True)
class TrainMemoryModel:
    """The constants of the training-memory model (see the module docstring)."""

    p_t: float
    """Bytes per trained parameter (gradient, AdamW state, optimizer temporaries)."""
    p_all: float
    """Bytes per parameter, trained or not, during an update."""
    p_bf16: float
    """Extra bytes per parameter under bf16 mixed precision (autocast's bf16 copies)."""
    p_ckpt: float
    """Change of the fixed part per parameter with activation checkpointing."""
    o_fsdp: float
    """Per-rank fixed part under FSDP2 is ``(1/dp + o_fsdp)`` of the unsharded one."""
    a: float
    """Activation bytes per token, hidden unit and layer (fp32, no checkpointing)."""
    d_bf16: float = 0.0
    d_ckpt: float = 0.0
    d_lora: float = 0.0
    d_fsdp: float = 0.0

    def train_bytes(
        self,
        params: float,
        trainable: float,
        hidden: int,
        layers: int,
        tokens: int,
        *,
        bf16: bool = False,
        checkpointing: bool = False,
        lora: bool = False,
        fsdp_ranks: int = 0,
    ) -> float:
        """Bytes an update of ``tokens``-token micro-batches adds to the loaded weights on one
        rank (``fsdp_ranks`` 0: not sharded)."""
        fixed = self.p_t * trainable + self.p_all * params
        if bf16:
            fixed += self.p_bf16 * params
        if checkpointing:
            fixed += self.p_ckpt * params
        per = self.a
        for on, d in (
            (bf16, self.d_bf16),
            (checkpointing, self.d_ckpt),
            (lora, self.d_lora),
            (fsdp_ranks > 0, self.d_fsdp),
        ):
            per += d if on else 0.0
        slope = per * hidden * layers
        if fsdp_ranks > 0:
            fixed *= 1.0 / fsdp_ranks + self.o_fsdp
        return max(fixed, 0.0) + max(slope, 0.0) * tokens

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp32_ckpt": {"checkpointing": True},
    "lora": {"lora": True},
    "fsdp2_x2": {"fsdp_ranks": 2},
}
"""The flags of each ``bench/scale.py`` configuration in :meth:`TrainMemoryModel.train_bytes`."""


def _line(m1: float, m2: float, t1: int, t2: int) -> tuple[float, float]:
    """(fixed, slope) of the line through (t1, m1) and (t2, m2)."""
    if t2 <= t1:
        raise ValueError(f"fit: the second micro-batch ({t2} tokens) must exceed the first ({t1})")
    slope = (m2 - m1) / (t2 - t1)
    return m1 - slope * t1, slope


def fit(first: Mapping[str, Any], second: Mapping[str, Any], t1: int, t2: int) -> TrainMemoryModel:
    """Fit the constants from two ``bench/scale.py`` JSON lines at micro-batches of ``t1`` and
    ``t2`` tokens (same model; each has ``params``, ``hidden``, ``layers`` and, per
    configuration, ``train_peak_mb`` and ``trainable_params``). Formulas: module docstring."""
    n, h, layers = float(first["params"]), int(first["hidden"]), int(first["layers"])
    if (float(second["params"]), int(second["hidden"]), int(second["layers"])) != (n, h, layers):
        raise ValueError("fit: the two bench lines are of different models")
    for name in BENCH_CONFIGS:
        for line in (first, second):
            if name not in line:
                raise ValueError(f"fit: configuration {name!r} missing from a bench line")
    lines = {
        k: _line(first[k]["train_peak_mb"] * MB, second[k]["train_peak_mb"] * MB, t1, t2)
        for k in BENCH_CONFIGS
    }
    fixed = {k: v[0] for k, v in lines.items()}
    slope = {k: v[1] for k, v in lines.items()}
    n_lora = float(first["lora"]["trainable_params"])
    # fixed_fp32 = (p_t + p_all) n ; fixed_lora = p_t n_lora + p_all n
    p_t = (fixed["fp32"] - fixed["lora"]) / (n - n_lora)
    p_all = fixed["fp32"] / n - p_t
    base = slope["fp32"]
    return TrainMemoryModel(
        p_t=p_t,
        p_all=p_all,
        p_bf16=(fixed["bf16"] - fixed["fp32"]) / n,
        p_ckpt=(fixed["fp32_ckpt"] - fixed["fp32"]) / n,
        o_fsdp=fixed["fsdp2_x2"] / fixed["fp32"] - 0.5,
        a=base / (h * layers),
        d_bf16=(slope["bf16"] - base) / (h * layers),
        d_ckpt=(slope["fp32_ckpt"] - base) / (h * layers),
        d_lora=(slope["lora"] - base) / (h * layers),
        d_fsdp=(slope["fsdp2_x2"] - base) / (h * layers),
    )


def estimate_mb(
    model: TrainMemoryModel,
    config: str,
    params: float,
    trainable: float,
    hidden: int,
    layers: int,
    tokens: int,
) -> float:
    """The model's ``train_peak_mb`` of one ``bench/scale.py`` configuration."""
    flags = BENCH_CONFIGS[config]
    return model.train_bytes(params, trainable, hidden, layers, tokens, **flags) / MB


CALIBRATED = TrainMemoryModel(
    p_t=12.7937,
    p_all=9.5497,
    p_bf16=-0.072,
    p_ckpt=-5.7611,
    o_fsdp=0.2702,
    a=-3.752,
    d_bf16=8.391,
    d_ckpt=47.283,
    d_lora=66.873,
    d_fsdp=47.336,
)
"""``fit`` of two ``bench/scale.py`` runs on this project's 2-core CPU (Llama 50.3M, hidden 512,
16 layers, 8 rows of 64 tokens, micro-batches of 4 and 8 rows = 256 and 512 tokens):

    bench/scale.py --micro 4 > b4.json; bench/scale.py --micro 8 --steps 1 > b8.json
    bench/scale.py --fit b4.json b8.json

Reading: 12.8 bytes per trained parameter (gradient + AdamW m, v: 12) and 9.5 per parameter
whatever trains (the optimizer step's and autograd's temporaries); the fp32 peak does not grow
with the tokens at these sizes (``a`` ~ 0: it is set by the optimizer step), LoRA's grows by
63 bytes per token, hidden unit and layer (its peak is the backward), checkpointing's by 44.
Out of sample (128 tokens, ``--micro 2``) the estimates are off by -16% (FSDP2) to +32% (LoRA):
valid for 256-512-token micro-batches; the peak is not linear below (docs/scale.md)."""

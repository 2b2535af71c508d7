"""GPU-hours and money: SFT-style training, one RL step, model memory, two-pool pipelines.

* Training compute (SFT, pre-training):
  ``GPU-hours = 6 * N_active * N_tokens / (peak * MFU * 3600)``. A dense 7B model on 1e9
  tokens at 989 TFLOP/s and MFU 0.4: 4.2e19 / 1.424e18 = 29.5 GPU-hours.
* One RL step ``C = C_rollout + C_actor_update + C_ref_forward + C_reward`` (+ critic for
  PPO), each in GPU-seconds: rollout from the roofline decode model (memory bound, batch
  ``c`` sequences per GPU), the rest ``f * N * tokens / (peak * MFU)`` with ``f = 6`` for an
  update and ``2`` for a forward pass.
* FLOPs of a batch: generating ``B`` answers of ``L`` tokens costs ``2 * N * B * L`` FLOP,
  training on them ``6 * N * B * L`` (B = 1024, L = 512: ``~1e6 N`` vs ``~3e6 N``); decoding is
  memory-bound, so the wall-clock times end up comparable.
* Memory of a set of models: 16 bytes per trained parameter (mixed-precision Adam), 2 per
  frozen parameter.
* Money: ``GPU-hours * price per GPU-hour``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relayrl.plan.hardware import HardwareSpec
from relayrl.plan.models import ModelSpec
from relayrl.plan.timemodel import RooflineTimeModel

__all__ = [
    "RLStepCost",
    "generation_vs_training_flops",
    "gpu_hours",
    "model_set_memory_bytes",
    "money",
    "rl_step_cost",
    "training_gpu_hours",
    "two_pool_pipeline",
]


def gpu_hours(n_params: float, n_tokens: float, peak_flops: float, mfu: float) -> float:
    """``6 * N * T / (peak * MFU * 3600)`` GPU-hours (N active params, T tokens)."""
    if n_params <= 0 or n_tokens < 0 or peak_flops <= 0 or not 0 < mfu <= 1:
        raise ValueError("need n_params > 0, n_tokens >= 0, peak_flops > 0, 0 < mfu <= 1")
    return 6.0 * n_params * n_tokens / (peak_flops * mfu * 3600.0)


def training_gpu_hours(
    model: ModelSpec, n_tokens: float, hardware: HardwareSpec, mfu: float = 0.4
) -> float:
    """:func:`gpu_hours` for a model spec on a hardware spec."""
    return gpu_hours(model.params, n_tokens, hardware.peak_flops, mfu)


def money(hours: float, price_per_gpu_hour: float) -> float:
    """``GPU-hours * price`` (currency of the price)."""
    if hours < 0 or price_per_gpu_hour < 0:
        raise ValueError("hours and price must be >= 0")
    return hours * price_per_gpu_hour


def model_set_memory_bytes(models: list[tuple[float, bool]]) -> float:
    """``sum (16 if trained else 2) * params`` over ``(params, trained)`` pairs.

    Actor and critic trained, reference and reward frozen, all 7B: 252e9 bytes; all 70B:
    2520e9 bytes (1120 + 1120 + 140 + 140 GB).
    """
    return sum(p * (16 if trained else 2) for p, trained in models)


def generation_vs_training_flops(n_params: float, batch: int, tokens: int) -> tuple[float, float]:
    """``(2 N B L, 6 N B L)`` FLOP for generating and training on ``B`` answers of ``L`` tokens."""
    return 2.0 * n_params * batch * tokens, 6.0 * n_params * batch * tokens


@dataclass
class RLStepCost:
    """GPU-seconds of one RL step by component, and the money it costs."""

    components: dict[str, float]
    price_per_gpu_hour: float

    @property
    def total_gpu_s(self) -> float:
        return sum(self.components.values())

    @property
    def gpu_hours(self) -> float:
        return self.total_gpu_s / 3600.0

    def share(self, name: str) -> float:
        return self.components[name] / self.total_gpu_s

    @property
    def cost(self) -> float:
        return money(self.gpu_hours, self.price_per_gpu_hour)

    def to_dict(self) -> dict[str, Any]:
        return {
            **{f"{k}_gpu_s": round(v, 3) for k, v in self.components.items()},
            **{f"{k}_share": round(self.share(k), 4) for k in self.components},
            "gpu_hours": round(self.gpu_hours, 5),
            "cost": round(self.cost, 4),
        }


def rl_step_cost(
    actor: ModelSpec,
    hardware: HardwareSpec,
    prompts: int = 512,
    samples_per_prompt: int = 8,
    prompt_len: int = 512,
    response_len: int = 2048,
    mfu: float = 0.4,
    decode_efficiency: float = 0.6,
    decode_batch: int = 64,
    ref: ModelSpec | None = None,
    reward: ModelSpec | None = None,
    critic: ModelSpec | None = None,
    tail_factor: float = 1.0,
    price_per_gpu_hour: float | None = None,
) -> RLStepCost:
    """Cost of one step of GRPO/PPO (defaults: GRPO, 512 prompts x 8 rollouts).

    Rollout: ``B * L / (c / t_step(c)) * tail_factor`` GPU-seconds with ``c = decode_batch``
    sequences per GPU and ``t_step`` from :class:`~relayrl.plan.timemodel.RooflineTimeModel`
    at the mean context; ``tail_factor >= 1`` charges idle slots while a long tail finishes
    (1 = a continuously full engine). Actor update ``6 N T``, reference and reward forward
    ``2 N T``, critic forward + update ``8 N T``, all over ``peak * MFU``; ``T = B * (prompt +
    response)``. ``reward=None`` means a rule-based verifier (cost ~0 on GPUs).
    """
    if prompts < 1 or samples_per_prompt < 1 or response_len < 1 or decode_batch < 1:
        raise ValueError("prompts, samples_per_prompt, response_len and decode_batch must be >= 1")
    if tail_factor < 1:
        raise ValueError("tail_factor must be >= 1")
    B = prompts * samples_per_prompt
    T = B * (prompt_len + response_len)
    tm = RooflineTimeModel(actor, hardware, decode_efficiency, mfu)
    step = tm.decode_step_time(decode_batch, decode_batch * (prompt_len + response_len / 2))
    rollout = B * response_len * step / decode_batch * tail_factor
    rollout += tm.prefill_time(B * prompt_len, 1)
    pf = hardware.peak_flops * mfu
    comps = {
        "rollout": rollout,
        "actor_update": 6.0 * actor.params * T / pf,
        "ref_forward": 2.0 * ref.params * T / pf if ref is not None else 0.0,
        "reward": 2.0 * reward.params * T / pf if reward is not None else 0.0,
    }
    if critic is not None:
        comps["critic"] = 8.0 * critic.params * T / pf
    price = hardware.price_per_hour if price_per_gpu_hour is None else price_per_gpu_hour
    return RLStepCost(comps, price)


def two_pool_pipeline(gen_frac: float, train_frac: float, sync_frac: float) -> dict[str, float]:
    """Two equal pools (generation, training) whose serial step splits into fractions.

    Serial: each pool is busy only in its own phase; utilisation ``(g + t) / 2``. Pipelined
    (the pools work on different steps at once): a step takes ``max(g, t) + s`` of the serial
    time, and with the sync hidden the pools are busy ``(g + t) / (2 max(g, t))``.
    Example (rollout 45%, training 50%, sync 5%): serial utilisation 47.5%; pipelined wall
    time 55% of serial (1.82x faster); pipelined utilisation up to 95%.
    """
    total = gen_frac + train_frac + sync_frac
    if min(gen_frac, train_frac, sync_frac) < 0 or not math.isclose(total, 1.0, abs_tol=1e-9):
        raise ValueError("fractions must be >= 0 and sum to 1")
    wall = max(gen_frac, train_frac) + sync_frac
    return {
        "serial_utilisation": (gen_frac + train_frac) / 2,
        "pipelined_wall_fraction": wall,
        "pipelined_speedup": 1.0 / wall,
        "pipelined_utilisation": (gen_frac + train_frac) / (2 * max(gen_frac, train_frac)),
    }

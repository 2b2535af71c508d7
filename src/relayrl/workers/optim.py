"""Optimizer set-up shared by trainable roles: AdamW with linear warmup."""

from __future__ import annotations

import torch


def make_optimizer(
    params: list[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW; lr ramps linearly from lr/(warmup+1) to lr over ``warmup_steps`` steps, then stays."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

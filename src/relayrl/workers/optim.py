"""Optimizer set-up shared by trainable roles: AdamW with linear warmup."""

from __future__ import annotations

from typing import Any

import torch


def make_optimizer(
    params: list[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    decay_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW; lr ramps linearly from lr/(warmup+1) to lr over ``warmup_steps`` steps, then
    stays (``decay_steps`` None) or decays linearly to ``min_lr_ratio * lr`` at ``decay_steps``."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)

    def factor(step: int) -> float:
        warm = min(1.0, (step + 1) / (warmup_steps + 1))
        if decay_steps is None or step < warmup_steps:
            return warm
        frac = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
        return warm * (1.0 - (1.0 - min_lr_ratio) * frac)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
) -> dict[str, Any]:
    """The checkpointable training state of a replicated role: optimizer, LR scheduler and
    shuffling generator."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "generator": generator.get_state(),
    }


def load_train_state(
    state: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    generator: torch.Generator,
) -> None:
    """Restore what ``train_state`` returned."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    generator.set_state(state["generator"])

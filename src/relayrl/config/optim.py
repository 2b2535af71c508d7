"""The ``optim`` section: the optimizer."""

from __future__ import annotations

from pydantic import Field

from relayrl.config.base import (
    AdamBeta,
    _Strict,
)


class OptimConfig(_Strict):
    lr: float = Field(5e-4, gt=0)
    critic_lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.99)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    """Gradient-norm clip (> 0; null: no clipping)."""

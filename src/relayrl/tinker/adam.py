"""The SDK's ``AdamParams`` of an ``optim_step``, checked.

relayrl applies them with ``torch.optim.AdamW`` (decoupled weight decay): at step t, per
parameter, ``p *= 1 - lr wd``; ``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``;
``p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``. ``grad_clip_norm`` > 0 first
scales the gradients to at most that global L2 norm (0: no clipping).
"""

from __future__ import annotations

import math
from typing import Any

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
"""The SDK's ``AdamParams`` defaults."""


def check_adam_params(adam: dict[str, Any]) -> dict[str, float]:
    """``AdamParams`` with defaults filled in; ValueError unless every value is finite,
    ``learning_rate``, ``eps``, ``weight_decay``, ``grad_clip_norm`` >= 0 and
    0 <= ``beta1``, ``beta2`` < 1."""
    out = {}
    for key, default in ADAM_DEFAULTS.items():
        raw = adam.get(key, default)
        value = math.nan if raw is None else float(raw)  # the SDK sends NaN / inf as null
        bad = not math.isfinite(value) or value < 0 or (key.startswith("beta") and value >= 1)
        if bad:
            rule = "in [0, 1)" if key.startswith("beta") else "finite and >= 0"
            got = "null (NaN or infinity)" if raw is None else value
            raise ValueError(f"AdamParams.{key} must be {rule}, got {got}")
        out[key] = value
    return out

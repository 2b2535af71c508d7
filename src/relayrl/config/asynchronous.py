"""The ``async`` section: the staleness bound and interruptible updates of ``schedule: async``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.base import (
    Fraction,
    _Strict,
)


class AsyncConfig(_Strict):
    """Overlap / async schedules (AReaL): staleness bound and interruption."""

    eta: int | None = Field(2, ge=0)
    """Staleness bound in steps: floor((N_r - 1) / B) <= i + eta (null: unbounded).
    ``schedule: overlap`` always uses eta = 1 without interruption."""
    interrupt: bool = True
    """On a weight update, in-flight sequences re-prefill under the new weights."""
    in_order: bool = True
    """Train the groups in admission order: step s waits for the groups admitted for step s,
    so every trained token is at most eta versions old. false: the oldest finished groups (no
    wait for stragglers; they are trained later and staler than eta)."""
    max_token_staleness: int | None = Field(None, ge=0)
    """Consumption-side bound on (trainer version - token version); null: no check."""
    stale_tokens: Literal["drop", "downweight"] = "drop"
    """What happens to a token over ``max_token_staleness``: its advantage is zeroed (it still
    counts in the loss denominator) or multiplied by ``stale_weight``."""
    stale_weight: Fraction = 0.5
    poll_interval_s: float = Field(0.01, gt=0)
    urgent_steps: int = Field(4, ge=0)
    """While the in-order trainer waits for some groups, the engine follows each full step
    with this many steps that decode only those groups' rows (0: off): a few stragglers alone
    step faster than a full batch (bench/schedules.py; figures: docs/measurements.md)."""

"""Schedule policies of the simulator: when a sample may start and when the trainer may take
a batch. One mechanism, three settings:

* ``sync`` - colocated; gate ``eta = 0`` (batch ``k`` starts once the trainer is at version
  ``k``) plus a batch barrier. Every token has staleness 0.
* ``overlap`` - one-step off-policy on split devices: gate ``eta = 1`` plus a batch barrier
  (batch ``k+1`` starts only once batch ``k`` has finished generating).
* ``async`` - AReaL: continuous generation, gate ``floor((N_r - 1)/B) <= i + eta``
  (:mod:`relayrl.plan.staleness`); the trainer takes step ``k``'s admitted samples once they
  have all finished (``in_order``) or the oldest ``B`` finished ones (finish order);
  ``interrupt`` re-prefills in-flight sequences under new weights.

Multi-turn episodes: the batch schedules run turns in lock-step by default
(``SimConfig.turn_barrier``: a batch's turn ``j + 1`` starts once every episode of the batch
has finished turn ``j`` and the slowest environment call of the batch has returned: the batch
waits); ``async`` lets each episode wait alone while its slot serves others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from relayrl.plan.staleness import admission_allowed, batch_index

__all__ = ["Schedule", "SchedulePolicy"]

Schedule = Literal["sync", "overlap", "async"]


@dataclass(frozen=True)
class SchedulePolicy:
    """The rules one schedule runs by (see the module docstring)."""

    name: Schedule
    eta: int | None
    barrier: bool
    colocated: bool
    interrupt: bool
    in_order: bool

    @classmethod
    def of(cls, schedule: Schedule, eta: int | None, interrupt: bool, in_order: bool):
        if schedule == "sync":
            return cls("sync", 0, True, True, False, True)
        if schedule == "overlap":
            return cls("overlap", 1, True, False, False, True)
        return cls("async", eta, False, False, interrupt, in_order)

    def may_admit(
        self, n: int, gen_version: int, batch: int, cap: int, complete: Callable[[int], bool]
    ) -> bool:
        """May sample number ``n`` (1-based) start now? ``complete(b)``: batch ``b`` done."""
        if n > cap or not admission_allowed(n, gen_version, self.eta, batch):
            return False
        if self.barrier:
            b = batch_index(n, batch)
            if b > 0 and not complete(b - 1):
                return False
        return True

    def may_train(
        self, step: int, finished: int, batch: int, complete: Callable[[int], bool]
    ) -> bool:
        """May the trainer start ``step`` with ``finished`` samples waiting?"""
        if finished < batch:
            return False
        return not ((self.barrier or self.in_order) and not complete(step))

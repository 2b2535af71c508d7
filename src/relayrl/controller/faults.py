"""How a run refuses, fails or stops: one-line errors and the SIGINT / SIGTERM path.

Three kinds, three exit codes of ``relayrl train`` (``relayrl.cli``):

- :class:`RunDirError` (a ``ValueError``, exit 2): the run directory cannot be used as asked
  (it holds another run, another process holds it, nothing is left to resume, it cannot be
  written). Raised before anything is written into it.
- :class:`RunFault` (exit 1): something failed during the run (a checkpoint write, disk full,
  I/O error); the message says what failed and which checkpoint is the newest intact one.
- :class:`RunInterrupted` (a ``KeyboardInterrupt``, exit 128 + signal: 130 for SIGINT, 143 for
  SIGTERM): the run was stopped by a signal; once the trainer has handled it, the message says
  after which step and which checkpoint to continue from.

SIGTERM is turned into the same exception as Ctrl-C (:func:`raise_interrupt`), so every
``finally`` and ``except KeyboardInterrupt`` of the program cleans up the same way for both.
:class:`StepGuard` holds a signal that arrives while a step changes the weights until that
step has ended, so the checkpoint written on a signal is always of a completed step.

This module imports only the standard library: the CLI installs its SIGTERM handler from it
without loading torch.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

__all__ = [
    "CheckpointWriteError",
    "RunDirError",
    "RunFault",
    "RunInterrupted",
    "StepGuard",
    "raise_interrupt",
    "signal_name",
]

F = TypeVar("F", bound=Callable[..., Any])


class RunDirError(ValueError):
    """The run directory cannot be used as asked; nothing was written. One line."""


class RunFault(RuntimeError):
    """A fault during a run (I/O, disk full): what failed and the newest intact checkpoint."""


class CheckpointWriteError(RunFault):
    """A checkpoint could not be written; its temporary folder was removed."""


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ``SIGINT`` for 2, ``signal 42`` for one without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by ``signum``; ``message`` is the one line for the user (set by the
    trainer once it knows what it saved; empty before)."""

    def __init__(self, signum: int = signal.SIGINT, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal_name(signum)}")
        self.signum = int(signum)
        self.message = message

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + signal number."""
        return 128 + self.signum


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """A signal handler: stop the main thread with :class:`RunInterrupted` (as Ctrl-C does)."""
    raise RunInterrupted(signum)


class StepGuard:
    """Routes SIGINT and SIGTERM while a run trains; holds one that arrives mid-update.

    A step first generates and scores (the models are still those of the last completed step:
    a signal stops the run at once and that step can be checkpointed), then updates the weights
    (``wrap`` marks the update methods; from the first call on, the step is *committing*). A
    signal while committing is held until :meth:`end_step`, which raises it once the step is
    complete; a second signal raises at once and the step is abandoned (:attr:`clean` False:
    the weights are half-updated and must not be saved). With ``hold=False`` every signal
    raises at once (``train.save_on_signal: false``: nothing is saved on a signal anyway).

    Handlers are installed only from the main thread (the only one Python delivers signals to)
    and the previous ones are put back by :meth:`restore`.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.committing = False
        self.pending: int | None = None
        self.clean = True
        self._previous: dict[int, Any] = {}

    def install(self) -> StepGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.hold and self.committing and self.pending is None:
            self.pending = signum  # the step ends first (end_step raises it)
            return
        if self.committing:
            self.clean = False  # a second signal: the update is abandoned half-way
        raise RunInterrupted(self.pending or signum)

    def wrap(self, update: F) -> F:
        """``update`` that marks the current step as committing before it changes weights."""

        def committing_update(*args: Any, **kwargs: Any) -> Any:
            self.committing = True
            return update(*args, **kwargs)

        return committing_update  # type: ignore[return-value]

    def end_step(self) -> None:
        """The step is complete (logged): raise a signal held during it, if any."""
        self.committing = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise RunInterrupted(signum)

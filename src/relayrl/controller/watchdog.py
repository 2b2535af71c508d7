"""The stall watchdog of a blocking rollout: no progress for ``failures.stall_s`` is an error.

The sync schedule (and ``--rollout-only``) generates and scores a step in blocking calls: an
engine that stops decoding, a reward function or scorer that never returns, an environment or
agent that hangs past its own timeout would hang the run silently. :func:`run_watched` runs
such a rollout on a daemon thread and waits for it in the calling thread. The rollout reports
where it is through a :class:`Progress` (``mark("scoring 16 samples")``); a ``probe`` reads
counters that move while a phase is under way (the engine's generated tokens and finished
requests, the reward role's scored samples). Progress is a new mark or a probe whose value
changed; after ``stall_s`` seconds without either, :class:`RolloutStalled` names the phase
that is stuck and since when. The stuck call is abandoned on its daemon thread (it never keeps
the process from exiting); the run ends with that one line (exit 1).

The async schedules have their own: the rollout controller raises :class:`RolloutStalled` when
the trainer waits while no sample finished for ``failures.stall_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from relayrl.controller.faults import RunFault

T = TypeVar("T")

__all__ = ["Progress", "RolloutStalled", "no_mark", "run_watched"]


class RolloutStalled(RunFault):
    """A rollout made no progress for ``failures.stall_s`` (one line naming what is stuck)."""


def no_mark(what: str) -> None:
    """A progress mark nobody watches."""


class Progress:
    """Where a watched rollout is (its phase) and when it last moved (monotonic seconds)."""

    def __init__(self, what: str = "starting") -> None:
        self._lock = threading.Lock()
        self.what = what
        self.since = self.at = time.monotonic()
        self.marks = 0

    def mark(self, what: str) -> None:
        """The rollout entered phase ``what`` (progress)."""
        with self._lock:
            self.what = what
            self.since = self.at = time.monotonic()
            self.marks += 1

    def touch(self) -> None:
        """The current phase moved (a probe's counters changed)."""
        with self._lock:
            self.at = time.monotonic()

    def idle(self) -> float:
        """Seconds since the last progress."""
        with self._lock:
            return time.monotonic() - self.at

    def describe(self) -> str:
        with self._lock:
            return f"{self.what} (for {time.monotonic() - self.since:.0f} s)"


def _bounded(probe: Callable[[], Hashable], timeout_s: float) -> Hashable | None:
    """``probe()`` on a daemon thread, None when it raised or did not return in time (a
    backend whose report waits behind the stuck call tells nothing)."""
    box: Future[Hashable] = Future()

    def run() -> None:
        try:
            box.set_result(probe())
        except BaseException as exc:  # reported as "no information"
            box.set_exception(exc)

    threading.Thread(target=run, name="rollout-probe", daemon=True).start()
    try:
        return box.result(timeout=timeout_s)
    except Exception:
        return None


def run_watched(
    work: Callable[[Callable[[str], None]], T],
    stall_s: float | None,
    probe: Callable[[], Hashable] | None = None,
    poll_s: float = 0.2,
) -> T:
    """``work(mark)``'s result, or :class:`RolloutStalled` once neither a ``mark`` nor a
    change of ``probe()`` came for ``stall_s`` seconds. The probe's value is taken after each
    mark (the phase's baseline) and compared when ``stall_s`` passed without progress (each
    call waited for at most ``min(stall_s, 10)`` s). ``stall_s`` None: ``work`` runs in this
    thread, unwatched. An exception of ``work`` is raised here."""
    if stall_s is None:
        return work(no_mark)
    progress = Progress()
    wait = min(stall_s, 10.0)
    seen = _bounded(probe, wait) if probe is not None else None
    marks = 0
    box: Future[T] = Future()

    def run() -> None:
        try:
            box.set_result(work(progress.mark))
        except BaseException as exc:  # raised in the watching thread
            box.set_exception(exc)

    threading.Thread(target=run, name="watched-rollout", daemon=True).start()
    while True:
        try:
            return box.result(timeout=poll_s)
        except FutureTimeout:
            pass
        if probe is not None and progress.marks != marks:  # a new phase: its baseline
            marks = progress.marks
            seen = _bounded(probe, wait)
        if progress.idle() <= stall_s:
            continue
        if probe is not None:
            now = _bounded(probe, wait)
            if now is not None and now != seen:
                seen = now
                progress.touch()
                continue
        if box.done():
            return box.result()
        raise RolloutStalled(
            f"rollout stalled: no progress for {progress.idle():.0f} s "
            f"(failures.stall_s={stall_s:g}); stuck: {progress.describe()}"
        )

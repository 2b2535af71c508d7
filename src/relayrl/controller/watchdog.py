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

The held-out evaluation is watched by the same judgement (:class:`Watch`, one per watched
work): between sync steps through :func:`run_watched` (its phases marked by
``evaluate_prompts``, its probe the evaluation engine's counters and the reward role's), and a
background evaluation on a replica of its own the same way, judged each time the trainer
collects it (``controller.background_eval``). Either stops the run with
:class:`EvalStalled`, one line naming the evaluation and its step.

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

__all__ = ["EvalStalled", "Progress", "RolloutStalled", "Watch", "no_mark", "run_watched"]


class RolloutStalled(RunFault):
    """A rollout made no progress for ``failures.stall_s`` (one line naming what is stuck)."""


class EvalStalled(RolloutStalled):
    """A held-out evaluation made no progress for ``failures.stall_s``; its message names the
    evaluation and the step it evaluates (``held-out evaluation at step 4 stalled: ...``)."""


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


class Watch:
    """The watchdog's judgement of one watched work: progress is a :meth:`mark` or a change of
    ``probe()``; :meth:`stalled` once neither came for ``stall_s`` seconds.

    The probe's value is taken after each mark (the phase's baseline, read at the next check)
    and compared only when ``stall_s`` passed without a mark (each call waited for at most
    ``min(stall_s, 10)`` s: a probe that does not answer tells nothing). Call :meth:`stalled`
    from one thread (the watching one); :meth:`mark` from any."""

    def __init__(
        self, stall_s: float, probe: Callable[[], Hashable] | None = None, what: str = "starting"
    ) -> None:
        self.stall_s = stall_s
        self.probe = probe
        self.progress = Progress(what)
        self._wait = min(stall_s, 10.0)
        self._seen = _bounded(probe, self._wait) if probe is not None else None
        self._marks = 0

    def mark(self, what: str) -> None:
        """The work entered phase ``what`` (progress)."""
        self.progress.mark(what)

    def stalled(self) -> bool:
        """Whether neither a mark nor a change of the probe came for ``stall_s`` seconds."""
        progress = self.progress
        if self.probe is not None and progress.marks != self._marks:  # a new phase: baseline
            self._marks = progress.marks
            self._seen = _bounded(self.probe, self._wait)
        if progress.idle() <= self.stall_s:
            return False
        if self.probe is not None:
            now = _bounded(self.probe, self._wait)
            if now is not None and now != self._seen:
                self._seen = now
                progress.touch()
                return False
        return True

    def describe(self) -> str:
        """``no progress for 3 s (failures.stall_s=2); stuck: <phase> (for 5 s)``."""
        return (
            f"no progress for {self.progress.idle():.0f} s "
            f"(failures.stall_s={self.stall_s:g}); stuck: {self.progress.describe()}"
        )


def run_watched(
    work: Callable[[Callable[[str], None]], T],
    stall_s: float | None,
    probe: Callable[[], Hashable] | None = None,
    poll_s: float = 0.2,
    what: str = "rollout",
    error: type[RolloutStalled] = RolloutStalled,
) -> T:
    """``work(mark)``'s result, or ``error("<what> stalled: no progress for ...")`` once
    neither a ``mark`` nor a change of ``probe()`` came for ``stall_s`` seconds
    (:class:`Watch`). ``stall_s`` None: ``work`` runs in this thread, unwatched. An exception
    of ``work`` is raised here."""
    if stall_s is None:
        return work(no_mark)
    watch = Watch(stall_s, probe)
    box: Future[T] = Future()

    def run() -> None:
        try:
            box.set_result(work(watch.mark))
        except BaseException as exc:  # raised in the watching thread
            box.set_exception(exc)

    threading.Thread(target=run, name="watched-rollout", daemon=True).start()
    while True:
        try:
            return box.result(timeout=poll_s)
        except FutureTimeout:
            pass
        if not watch.stalled():
            continue
        if box.done():
            return box.result()
        raise error(f"{what} stalled: {watch.describe()}")

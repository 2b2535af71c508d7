"""The held-out evaluation beside asynchronous training (``eval.background``).

In ``async`` / ``overlap`` the engine runs in its own process and keeps generating while the
trainer trains; an evaluation every ``train.eval_every`` steps that the trainer waited for
would stall training for its whole duration. :class:`BackgroundEval` runs it in a thread of its
own instead: its requests share the engine with training's (the engine's evaluation lane), its
answers are scored beside the rollout controller's, and the trainer goes on. Its metrics are
logged with the first step record after it finished, with ``eval/at_step`` (the trainer version
when it started) and ``eval/version_min`` / ``eval/version_max`` (the policy versions of the
tokens it generated: a weight update with interruption during the evaluation re-prefills its
sequences under the new weights). An evaluation still running when the next one is due is not
doubled: that one is skipped and counted (``eval/skipped``). With ``prepare`` (a separate
evaluation replica, ``relayrl.controller.eval_replica``) each evaluation that starts first
runs ``prepare(step)`` in the caller's thread: the replica loads the weights of that step.

Watched (``stall_s``, ``failures.stall_s``; the trainer passes it for a separate replica,
whose progress is the evaluation's own): the evaluation marks its phases and ``probe`` reads
what moves within one (``controller.watchdog.Watch``). Nothing waits for a background
evaluation, so it is judged where the trainer looks at it: each :meth:`collect`, and while
:meth:`collect` waits for it. One that made no progress for ``stall_s`` is an
:class:`~relayrl.controller.watchdog.EvalStalled` there (``held-out evaluation at step K (in
the background) stalled: ...``), as an evaluation that failed raises its error there; its
thread is abandoned (a daemon).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from relayrl.controller.watchdog import EvalStalled, Watch, no_mark

POLL_S = 0.2
"""Seconds between two looks at a watched evaluation that :meth:`BackgroundEval.collect`
waits for."""


class BackgroundEval:
    """Runs ``evaluate(mark)`` in a thread; :meth:`collect` gives its metrics once it finished."""

    def __init__(
        self,
        evaluate: Callable[[Callable[[str], None]], dict[str, float]],
        prepare: Callable[[int], None] | None = None,
        stall_s: float | None = None,
        probe: Callable[[], Hashable] | None = None,
    ) -> None:
        self._evaluate = evaluate
        self._prepare = prepare
        self._stall_s = stall_s
        self._probe = probe
        self._watch: Watch | None = None
        self._step = 0
        self._thread: threading.Thread | None = None
        self._result: dict[str, float] | None = None
        self._error: BaseException | None = None
        self.skipped = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int) -> bool:
        """Start an evaluation of the weights of version ``step``; False (counted) while the
        previous one still runs."""
        if self.running:
            self.skipped += 1
            return False
        self._result, self._error = None, None
        if self._prepare is not None:
            self._prepare(step)
        self._step = step
        watch = None if self._stall_s is None else Watch(self._stall_s, self._probe)
        self._watch = watch
        mark = no_mark if watch is None else watch.mark

        def run() -> None:
            try:
                self._result = {**self._evaluate(mark), "eval/at_step": float(step)}
            except BaseException as exc:  # raised in the trainer's thread by collect()
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True, name="held-out-eval")
        self._thread.start()
        return True

    def collect(self, wait: bool = False) -> dict[str, float]:
        """The finished evaluation's metrics (once), else {}; ``wait`` for a running one. An
        evaluation that failed raises its error here, one that stalled
        :class:`~relayrl.controller.watchdog.EvalStalled`."""
        thread = self._thread
        if thread is None:
            return {}
        while wait and thread.is_alive() and self._watch is not None:
            thread.join(POLL_S)
            self._check()
        if wait:
            thread.join()
        if thread.is_alive():
            self._check()
            return {}
        self._thread = None
        if self._error is not None:
            raise self._error
        out = dict(self._result or {})
        if self.skipped:
            out["eval/skipped"] = float(self.skipped)
        return out

    def _check(self) -> None:
        """:class:`EvalStalled` when the running evaluation is watched and stalled."""
        watch, thread = self._watch, self._thread
        if watch is None or thread is None or not watch.stalled() or not thread.is_alive():
            return
        self._thread = None  # abandoned: the run ends with this error
        raise EvalStalled(
            f"held-out evaluation at step {self._step} (in the background) stalled: "
            f"{watch.describe()}"
        )

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class BackgroundEval:
    """Runs ``evaluate`` in a thread; :meth:`collect` gives its metrics once it finished."""

    def __init__(
        self,
        evaluate: Callable[[], dict[str, float]],
        prepare: Callable[[int], None] | None = None,
    ) -> None:
        self._evaluate = evaluate
        self._prepare = prepare
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

        def run() -> None:
            try:
                self._result = {**self._evaluate(), "eval/at_step": float(step)}
            except BaseException as exc:  # raised in the trainer's thread by collect()
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True, name="held-out-eval")
        self._thread.start()
        return True

    def collect(self, wait: bool = False) -> dict[str, float]:
        """The finished evaluation's metrics (once), else {}; ``wait`` for a running one. An
        evaluation that failed raises its error here."""
        if self._thread is None:
            return {}
        if wait:
            self._thread.join()
        if self._thread.is_alive():
            return {}
        self._thread = None
        if self._error is not None:
            raise self._error
        out = dict(self._result or {})
        if self.skipped:
            out["eval/skipped"] = float(self.skipped)
        return out

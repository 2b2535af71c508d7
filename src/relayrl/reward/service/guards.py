"""What every reward result must satisfy before the trainer sees it, and a guarded call.

- ``checked``: the total, the outcome and every component must be finite (an ``inf`` in a
  weight-0 component would otherwise turn the total into NaN with no failure recorded), and
  there may be at most ``max_components`` components; otherwise the sample becomes a
  recorded failure naming the offending keys.
- ``call_guarded``: runs reward code and turns *any* exception, ``SystemExit`` and
  ``KeyboardInterrupt`` included, into a failed result. The only exception re-raised is the
  trainer's own interrupt: a SIGINT delivered while the call ran (noticed by wrapping the
  process's SIGINT handler for the call, in the main thread).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable
from typing import Any

from relayrl.reward.mixing import ScoreResult

__all__ = ["MAX_COMPONENTS", "call_guarded", "checked"]

MAX_COMPONENTS = 64


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def checked(
    result: ScoreResult, failure_score: float, max_components: int = MAX_COMPONENTS
) -> ScoreResult:
    """``result``, or a failure when something in it is not finite or there are too many
    components."""
    comps = result.components
    if len(comps) > max_components + 1:  # + the "score" entry
        return ScoreResult.failure(
            f"too many reward components: {len(comps) - 1} (at most {max_components})",
            failure_score,
            result.latency_s,
        )
    bad = sorted(str(k) for k, v in comps.items() if not _finite(v))
    if not _finite(result.score) or not _finite(result.outcome) or bad:
        what = ", ".join(f"{k}={comps[k]!r}" for k in bad[:5]) or f"score={result.score!r}"
        error = f"non-finite reward: {what}"
        if result.error:
            error = f"{result.error}; {error}"
        return ScoreResult.failure(error, failure_score, result.latency_s)
    return result


def call_guarded(fn: Callable[[], ScoreResult], failure_score: float) -> ScoreResult:
    """``fn()``; any exception from reward code becomes a failed result (see module doc)."""
    interrupted: list[int] = []
    installed = False
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, TypeError):
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):

                def on_sigint(signum: int, frame: Any) -> None:
                    interrupted.append(signum)
                    previous(signum, frame)

                signal.signal(signal.SIGINT, on_sigint)
                installed = True
    try:
        return fn()
    except KeyboardInterrupt as e:
        if interrupted:
            raise  # the trainer's own Ctrl-C
        return ScoreResult.failure(f"reward function raised KeyboardInterrupt: {e}", failure_score)
    except BaseException as e:  # SystemExit, GeneratorExit, ... from reward code
        return ScoreResult.failure(
            f"reward function raised {type(e).__name__}: {e}"[:500], failure_score
        )
    finally:
        if installed:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGINT, previous)

"""A background evaluation watched by the stall watchdog (``controller.background_eval``): the
trainer judges it where it looks at it (``collect``, and while ``collect`` waits for it). One
whose thread hangs ends in one ``EvalStalled`` line naming its step; one whose probe moves
is waited for, however long it takes; unwatched (``stall_s`` None), it is as before. Real
threads, synchronised by Events (a bound only a broken test reaches)."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest

from relayrl.controller import watchdog
from relayrl.controller.background_eval import BackgroundEval
from relayrl.controller.watchdog import EvalStalled, RolloutStalled, Watch, no_mark

BOUND_S = 60


def test_a_hung_background_evaluation_is_one_line_naming_its_step():
    never = threading.Event()  # never set: the evaluation's thread is abandoned

    def evaluate(mark):
        mark("RolloutEngine generating 4 requests")
        never.wait(BOUND_S)
        return {"eval/pass_rate": 1.0}

    bg = BackgroundEval(evaluate, stall_s=0.3, probe=lambda: (5, 1, 0))
    assert bg.start(3)
    with pytest.raises(EvalStalled) as e:
        bg.collect(wait=True)
    msg = str(e.value)
    assert isinstance(e.value, RolloutStalled) and "\n" not in msg
    assert msg.startswith("held-out evaluation at step 3 (in the background) stalled: "), msg
    assert "(failures.stall_s=0.3); stuck: RolloutEngine generating 4 requests (for " in msg
    assert not bg.running and bg.collect() == {}  # abandoned: nothing left to collect


def test_a_background_evaluation_whose_probe_moves_is_waited_for(monkeypatch):
    """It generates 3 units, each once the watchdog took the previous one for progress (past
    ``stall_s`` without a mark: a touch), so it runs for more than 3 x ``stall_s``."""
    touched, probed = threading.Event(), threading.Event()
    real_touch = watchdog.Progress.touch

    def touch(self):
        real_touch(self)
        touched.set()

    monkeypatch.setattr(watchdog.Progress, "touch", touch)
    done = itertools.count()
    units = [0]

    def probe():
        value = units[0]
        probed.set()  # after the read: the next unit moves what the baseline holds
        return value

    def evaluate(mark):
        probed.clear()
        mark("generating 3 requests")
        assert probed.wait(BOUND_S)  # the phase's baseline was read
        for _ in range(3):
            touched.clear()
            units[0] += 1
            assert touched.wait(BOUND_S)
            next(done)
        return {"eval/pass_rate": 0.5}

    bg = BackgroundEval(evaluate, stall_s=1.0, probe=probe)  # the probe waits <= 1 s
    bg.start(4)
    out = bg.collect(wait=True)
    assert out == {"eval/pass_rate": 0.5, "eval/at_step": 4.0}
    assert next(done) == 3


def test_unwatched_background_evaluation_gets_no_mark_and_no_watch():
    seen = []

    def evaluate(mark):
        seen.append(mark)
        return {"eval/n": 2.0}

    bg = BackgroundEval(evaluate)
    bg.start(2)
    assert bg.collect(wait=True) == {"eval/n": 2.0, "eval/at_step": 2.0}
    assert seen == [no_mark]


def test_a_failed_background_evaluation_still_raises_its_own_error():
    def evaluate(mark):
        mark("scoring")
        raise ValueError("reward service gone")

    bg = BackgroundEval(evaluate, stall_s=30, probe=lambda: 0)
    bg.start(1)
    with pytest.raises(ValueError, match="reward service gone"):
        bg.collect(wait=True)


def test_watch_is_stalled_only_without_mark_or_probe_change(monkeypatch):
    """``Watch.stalled`` on a hand-driven clock: idle <= stall_s is no stall; past it a changed
    probe is progress (idle restarts), an unchanged one a stall; a mark restarts idle and
    rebases the probe."""
    clock = [100.0]
    monkeypatch.setattr(watchdog, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    value = [0]
    w = Watch(5.0, lambda: value[0])
    clock[0] = 105.0  # idle 5 s: not past stall_s
    assert not w.stalled()
    clock[0] = 105.5
    value[0] = 1  # moved since the baseline 0
    assert not w.stalled() and w.progress.idle() == 0.0
    clock[0] = 111.0  # 5.5 s, probe still 1
    assert w.stalled()
    want = "no progress for 6 s (failures.stall_s=5); stuck: starting (for 11 s)"
    assert w.describe() == want
    w.mark("scoring 4 samples")  # progress; the baseline is read at the next check: 1
    clock[0] = 116.5
    assert w.stalled()

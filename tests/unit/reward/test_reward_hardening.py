"""Reward service hardening: non-finite scores and components are recorded failures, the
number of components is capped, inline mode survives ``SystemExit`` / ``KeyboardInterrupt``
from reward code (but not the trainer's own Ctrl-C), and leaking workers are recycled.

The reward functions are module-level so that workers import them as
``test_reward_hardening:NAME``.
"""

from __future__ import annotations

import math
import os
import signal
import threading

import pytest

from relayrl.reward import RewardMix, RewardService
from relayrl.reward.functions import evaluate

M = "test_reward_hardening"
_LEAK: list[bytes] = []


def plus_inf(prompt: str, completion: str, sample: dict) -> float:
    return math.inf


def minus_inf(prompt: str, completion: str, sample: dict) -> float:
    return -math.inf


def inf_side(prompt: str, completion: str, sample: dict) -> dict:
    return {"score": 1.0, "side": math.inf}


def nan_side(prompt: str, completion: str, sample: dict) -> dict:
    return {"score": 1.0, "side": math.nan}


def one(prompt: str, completion: str, sample: dict) -> float:
    return 1.0


def many(prompt: str, completion: str, sample: dict) -> dict:
    return {f"k{i}": 0.0 for i in range(200_000)}


def exits(prompt: str, completion: str, sample: dict) -> float:
    raise SystemExit(3)


def interrupts(prompt: str, completion: str, sample: dict) -> float:
    raise KeyboardInterrupt


def leak(prompt: str, completion: str, sample: dict) -> float:
    _LEAK.append(b"x" * (40 << 20))
    return float(os.getpid())


def pid(prompt: str, completion: str, sample: dict) -> float:
    return float(os.getpid())


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ([f"{M}:plus_inf"], "is inf"),
        ([f"{M}:minus_inf"], "is -inf"),
        ([f"{M}:inf_side"], "component 'side' is inf"),
        ([f"{M}:nan_side"], "component 'side' is nan"),
        ([f"{M}:one", {"fn": f"{M}:plus_inf", "weight": 0.0}], "is inf"),
    ],
    ids=["inf", "-inf", "inf-side", "nan-side", "inf-weight-0"],
)
def test_non_finite_is_a_recorded_failure(workers: int, spec: list, needle: str) -> None:
    with RewardService(RewardMix(spec), num_workers=workers) as svc:
        r = svc.submit_text("q", "c", {}).result(timeout=60)
        stats = svc.stats()
    assert r.failed and needle in r.error, r
    assert all(math.isfinite(v) for v in r.components.values()), r
    assert math.isfinite(r.score) and stats["reward_service/failed"] == 1.0


def test_too_many_components_is_a_failure_and_the_cap_is_checked_again() -> None:
    with RewardService(RewardMix([f"{M}:many"]), num_workers=0) as svc:
        r = svc.submit_text("q", "c", {}).result()
    assert r.failed and "200000 components, at most 66 allowed" in r.error
    assert len(r.components) <= 65
    with RewardService(RewardMix([f"{M}:inf_side"]), max_components=1) as svc:
        assert svc.max_components == 1
    with pytest.raises(ValueError, match="max_components must be >= 1, got 0"):
        RewardService(RewardMix([f"{M}:one"]), max_components=0)
    out, _ = evaluate(one, "", "", {})
    assert out == {"score": 1.0}


@pytest.mark.parametrize(
    ("fn", "needle"),
    [("exits", "raised SystemExit: 3"), ("interrupts", "raised KeyboardInterrupt")],
)
def test_inline_reward_code_cannot_stop_the_trainer(fn: str, needle: str) -> None:
    with RewardService(RewardMix([f"{M}:{fn}"]), num_workers=0) as svc:
        r = svc.submit_text("q", "c", {}).result()
        batch = svc.submit_text("q", "c", {}).result()
    assert r.failed and needle in r.error and batch.failed
    # off the main thread too (a trainer thread scoring inline)
    out: list = []
    with RewardService(RewardMix([f"{M}:{fn}"]), num_workers=0) as svc:
        t = threading.Thread(target=lambda: out.append(svc.submit_text("q", "c", {}).result()))
        t.start()
        t.join(30)
    assert out and out[0].failed


def sigint_self(prompt: str, completion: str, sample: dict) -> float:
    os.kill(os.getpid(), signal.SIGINT)  # the trainer's Ctrl-C arrives mid-call
    for _ in range(1000):
        pass
    return 1.0


def test_the_trainers_own_interrupt_still_propagates() -> None:
    """With Python's own SIGINT handler in place (set here: a test process may have been left
    with SIGINT ignored, under which no Ctrl-C reaches Python at all), a Ctrl-C that arrives
    during a reward call is the trainer's and propagates; the guard restores the handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with RewardService(RewardMix([f"{M}:sigint_self"]), num_workers=0) as svc:
            with pytest.raises(KeyboardInterrupt):
                svc.submit_text("q", "c", {}).result()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_workers_are_recycled_after_n_calls_and_above_rss() -> None:
    with RewardService(RewardMix([f"{M}:pid"]), num_workers=1, worker_max_calls=3) as svc:
        pids = [svc.submit_text("q", "c", {}).result(timeout=60).score for _ in range(7)]
        stats = svc.stats()
    assert len(set(pids)) == 3 and stats["reward_service/worker_recycled"] >= 2, pids
    assert stats["reward_service/failed"] == 0
    spec = RewardMix([f"{M}:leak"])
    with RewardService(spec, num_workers=1, worker_max_rss_mb=150, worker_max_calls=None) as svc:
        pids = [svc.submit_text("q", "c", {}).result(timeout=60).score for _ in range(8)]
        stats = svc.stats()
    # each call leaks 40 MB: a worker is replaced once it passes 150 MB, never grows past
    assert len(set(pids)) >= 2 and stats["reward_service/worker_recycled"] >= 1, pids
    with pytest.raises(ValueError, match="worker_max_calls must be >= 1 or None, got 0"):
        RewardService(RewardMix([f"{M}:one"]), worker_max_calls=0)
    with pytest.raises(ValueError, match="worker_max_rss_mb must be > 0 or None, got -1"):
        RewardService(RewardMix([f"{M}:one"]), worker_max_rss_mb=-1)

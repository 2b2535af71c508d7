"""The simulated-latency environment (relayrl.env.builtin.latency): waits drawn from the
planner's distribution, reproducible per (seed, prompt, sample index), done after `turns`."""

from __future__ import annotations

import asyncio
import time

import pytest

from relayrl.env.builtin.latency import LatencyEnv
from relayrl.env.registry import resolve_factory


def _episode(env: LatencyEnv, row: dict) -> tuple[list, float]:
    async def go():
        await env.reset(row)
        out = []
        t0 = time.perf_counter()
        for _ in range(env.turns):
            out.append(await env.step({"role": "assistant", "content": "x"}))
        return out, time.perf_counter() - t0

    return asyncio.run(go())


def test_waits_then_done_after_turns():
    env = LatencyEnv(turns=3, latency="fixed:0.05,0.1")
    results, took = _episode(env, {"prompt": "1+1=", "sample_index": 0})
    assert [r.done for r in results] == [False, False, True]
    assert results[0].observation == [{"role": "tool", "content": "ok"}]
    assert env.waits == [0.05, 0.1]
    assert took >= 0.15


def test_waits_are_reproducible_per_sample_and_differ_between_samples():
    spec = "lognormal:0.001:0.01:0.02"
    a = LatencyEnv(turns=4, latency=spec, seed=1)
    b = LatencyEnv(turns=4, latency=spec, seed=1)
    _episode(a, {"prompt": "2+2=", "sample_index": 1})
    _episode(b, {"prompt": "2+2=", "sample_index": 1})
    assert a.waits == b.waits and len(a.waits) == 3
    _episode(b, {"prompt": "2+2=", "sample_index": 2})
    assert b.waits[3:] != a.waits
    assert all(0 <= w <= 0.02 for w in b.waits)


def test_registered_and_bad_arguments_are_clear():
    env = resolve_factory("latency", {"turns": 2, "latency": "constant:0"})()
    assert isinstance(env, LatencyEnv) and env.turns == 2
    with pytest.raises(ValueError, match="turns"):
        LatencyEnv(turns=0)
    with pytest.raises(ValueError, match="latency"):
        LatencyEnv(latency="gamma:1")

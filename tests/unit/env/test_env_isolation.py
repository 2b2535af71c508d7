"""The environment execution layer enforces its limits: blocking code inside ``async def
step`` ends its own episode ``timeout`` at ``step_timeout_s`` (the cause named) while the others
go on, and every environment, idle or still in an episode, is closed at the end of a run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from relayrl.env import Environment, PlainRenderer, StepResult
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("iso") / "m", hidden_size=32, seed=3)
    return load_causal_lm(path).eval(), load_tokenizer(path)


class Blocking(Environment):
    """Rows with ``block`` sleep (blocking the thread) inside ``async def step``."""

    closed: list[int] = []
    created: list[int] = []

    def __init__(self, sleep_s: float = 4.0, hang_async_s: float = 0.0):
        self.sleep_s, self.hang_async_s = sleep_s, hang_async_s
        Blocking.created.append(id(self))

    async def reset(self, row):
        self.block = row.get("block", False)
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, message):
        if self.block:
            time.sleep(self.sleep_s)  # the bug this guards against: blocking code in async
        if self.hang_async_s:
            await asyncio.sleep(self.hang_async_s)
        return StepResult(done=True)

    async def close(self):
        Blocking.closed.append(id(self))


def _requests(n: int, blocked: set[int]) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=4, seed=i),
            group_id=i,
            metadata={"prompt": "1+1=", "block": i in blocked},
        )
        for i in range(n)
    ]


def _runner(model, tok, factory, timeout_s=1.0):
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    limits = RunnerLimits(max_turns=2, max_model_len=256, step_timeout_s=timeout_s)
    return EpisodeRunner(engine, factory, PlainRenderer(tok), limits, concurrency=32)


def test_blocking_code_in_async_step_times_out_its_own_episode_only(tiny):
    model, tok = tiny
    blocked = {0, 4, 8, 12, 16, 20, 24, 28}  # 8 of 32, as in the issue
    runner = _runner(model, tok, lambda: Blocking(sleep_s=4.0), timeout_s=1.0)
    t0 = time.perf_counter()
    try:
        samples = runner.generate(_requests(32, blocked))
        wall = time.perf_counter() - t0
        m = runner.env_metrics()
    finally:
        runner.close()
    reasons = [s.metadata["env"]["stop_reason"] for s in samples]
    assert [i for i, r in enumerate(reasons) if r == "timeout"] == sorted(blocked)
    assert reasons.count("env_done") == 24
    for i in blocked:
        assert "event loop was blocked" in samples[i].metadata["env"]["error"]
        assert sum(samples[i].loss_mask) == 0  # a recorded failure trains nothing
    assert wall < 3.5, wall  # the 4 s sleeps froze everything before (33 s for 32 episodes)
    assert m["env/stop_timeout"] == 8 and m["env/pool_blocked"] == 8


def test_every_environment_is_closed_at_the_end_of_a_run_also_in_flight(tiny):
    model, tok = tiny
    Blocking.closed, Blocking.created = [], []
    runner = _runner(model, tok, lambda: Blocking(hang_async_s=30.0), timeout_s=60.0)
    earlier = set(threading.enumerate())
    runner.submit_many(_requests(8, set()))
    deadline = time.monotonic() + 20
    while runner.pool.in_use < 8 and time.monotonic() < deadline:
        runner.poll(0.05)
    assert runner.pool.in_use == 8  # every episode waits in its step
    # this run's environment loop threads (EnvLoop("relayrl-env")), by identity: threads that
    # other tests left behind, starting or ending meanwhile, do not enter the count
    env_loops = [t for t in threading.enumerate() if t.name == "relayrl-env" and t not in earlier]
    runner.close()
    assert len(Blocking.created) == 8 and sorted(Blocking.closed) == sorted(Blocking.created)
    for t in env_loops:  # a stopped loop's thread returns from run_forever right after close
        t.join(timeout=10)
    assert len(env_loops) == 8 and not any(t.is_alive() for t in env_loops)  # threads gone

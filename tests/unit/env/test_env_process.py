"""``env.isolation: process``: an environment stuck in a busy loop is killed at
``step_timeout_s`` (its worker process is gone) and replaced; the others finish; a factory
that raises in the worker is the episode's recorded failure."""

from __future__ import annotations

import os
import time

import pytest

from relayrl.env import PlainRenderer
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("proc") / "m", hidden_size=32, seed=3)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split()[2] != "Z"


def _runner(model, tok, factory):
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    limits = RunnerLimits(max_turns=2, max_model_len=256, step_timeout_s=20.0)
    return EpisodeRunner(
        engine, factory, PlainRenderer(tok), limits, concurrency=2, isolation="process"
    )


def test_a_spinning_environment_is_killed_and_replaced(tiny, tmp_path, monkeypatch):
    from env_workers import Spinning

    model, tok = tiny
    pids = tmp_path / "pids"
    monkeypatch.setenv("RELAYRL_TEST_PIDS", str(pids))
    runner = _runner(model, tok, Spinning)
    runner.pool.timeout_s = 20.0  # worker start-up (a fresh interpreter) within this
    reqs = [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=3, seed=i),
            group_id=i,
            metadata={"prompt": "1+1=", "hang": i == 0},
        )
        for i in range(3)
    ]
    try:
        runner.limits.step_timeout_s = runner.pool.timeout_s = 20.0
        samples = runner.generate(reqs[1:])  # two healthy episodes: the workers start
        assert [s.metadata["env"]["stop_reason"] for s in samples] == ["env_done"] * 2
        runner.pool.timeout_s = 2.0  # now a step gets 2 s
        t0 = time.perf_counter()
        (hung,) = runner.generate(reqs[:1])
        assert time.perf_counter() - t0 < 15
        runner.pool.timeout_s = 20.0
        again = runner.generate(reqs[1:])  # the killed worker's place is taken by a new one
        assert [s.metadata["env"]["stop_reason"] for s in again] == ["env_done"] * 2
        m = runner.env_metrics()
    finally:
        runner.close()
    assert hung.metadata["env"]["stop_reason"] == "timeout"
    worker_pids = {int(x) for x in pids.read_text().split()}
    # the healthy episodes may share one worker or use two, as the pool schedules them; the
    # killed worker is replaced by a fresh one and every worker is gone at the end
    created = runner.pool.counters["created"]
    assert len(worker_pids) == created >= 2 and not any(_alive(p) for p in worker_pids)
    assert m["env/stop_timeout"] == 1
    assert runner.pool.counters["closed"] == created


def test_a_factory_that_raises_in_the_worker_is_a_recorded_failure(tiny):
    from env_workers import raising

    model, tok = tiny
    runner = _runner(model, tok, raising)
    runner.pool.timeout_s = 30.0
    try:
        (s,) = runner.generate(
            [GenerationRequest([1], SamplingParams(max_tokens=3), metadata={"prompt": "1"})]
        )
    finally:
        runner.close()
    assert s.metadata["env"]["stop_reason"] == "env_error"
    assert "RuntimeError: no environment today" in s.metadata["env"]["error"]

"""The episode runner on a real engine and a real tiny model: token-exact trajectories,
trainer recompute == behaviour logprobs on model tokens, versions across an interrupt in
turn 2, and every kind of environment failure isolated to its episode and counted."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from relayrl.config import RunConfig
from relayrl.env import EnvError, Environment, FunctionEnvironment, PlainRenderer, StepResult
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import episode_scores, scoring_view
from relayrl.env.tools import ToolEnvironment
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.workers import Experience
from relayrl.workers.actor import ReferenceWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("env") / "m", hidden_size=32, seed=3)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def make_engine(model, tok, **kw):
    return RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def scripted_env(turns_to_done: int = 2, obs: str = "ok") -> FunctionEnvironment:
    """user prompt from the row; each step answers ``obs``; done after ``turns_to_done``."""

    def reset(row, state):
        state["n"] = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(message, state):
        state["n"] += 1
        return StepResult(
            [{"role": "tool", "content": obs}],
            done=state["n"] >= turns_to_done,
            reward=0.5 if state["n"] < turns_to_done else 1.0,
        )

    return FunctionEnvironment(reset, step)


def requests(n: int, max_tokens: int = 6, prompt: str = "12*3=") -> list[GenerationRequest]:
    return [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=max_tokens, seed=100 + i),
            group_id=i // 2,
            metadata={"prompt": prompt, "answer": "36", "sample_index": i % 2},
        )
        for i in range(n)
    ]


def runner_for(engine, tok, factory, **kw) -> EpisodeRunner:
    lim = dict(max_turns=3, max_turn_tokens=6, max_model_len=256, step_timeout_s=5.0)
    lim.update({k: kw.pop(k) for k in list(kw) if k in lim or k == "max_total_tokens"})
    return EpisodeRunner(engine, factory, PlainRenderer(tok), RunnerLimits(**lim), **kw)


def test_episodes_are_token_exact_with_loss_masks(tiny):
    model, tok = tiny
    r = PlainRenderer(tok)
    runner = runner_for(make_engine(model, tok, max_slots=3), tok, lambda: scripted_env(2))
    try:
        samples = runner.generate(requests(4))
        metrics = runner.env_metrics()
    finally:
        runner.close()
    prompt = r.prompt([{"role": "user", "content": "12*3="}])
    obs = r.observation([{"role": "tool", "content": "ok"}])
    for s in samples:
        info = s.metadata["env"]
        assert info["stop_reason"] == "env_done" and info["turns"] == 2
        assert s.prompt_ids == prompt
        mask = s.loss_mask
        # model turn, then exactly the rendered observation (mask 0), then a model turn
        k = mask.index(0)
        assert s.response_ids[k : k + len(obs)] == obs and mask[k : k + len(obs)] == [0] * len(obs)
        assert all(m == 1 for m in mask[:k]) and all(m == 1 for m in mask[k + len(obs) :])
        assert 1 <= k <= 6 and 1 <= len(mask) - k - len(obs) <= 6
        assert s.versions == [0] * len(s.response_ids)
        assert info["turn_rewards"] == [0.5] and info["outcome"] == 1.0
        a, b = info["final_turn"]
        assert (a, b) == (k + len(obs), len(s.response_ids))
        assert scoring_view(s).response_ids == s.response_ids[a:b]
        assert s.metadata["answer"] == "36" and "_env_episode" not in s.metadata
    assert metrics["env/episodes"] == 4 and metrics["env/stop_env_done"] == 4
    assert metrics["env/turns_mean"] == 2 and metrics.get("env/failures", 0) == 0
    # per-turn rewards join the score with their coefficient; env outcome replaces it
    scores = episode_scores(samples, torch.zeros(4), "env", turn_reward_coef=0.2)
    assert torch.allclose(scores, torch.full((4,), 1.1))


def test_trainer_recompute_equals_behaviour_logprobs_on_model_tokens(tiny):
    model, tok = tiny
    model = copy.deepcopy(model).float()
    runner = runner_for(make_engine(model, tok, max_slots=4), tok, lambda: scripted_env(3, "408"))
    try:
        samples = runner.generate(requests(6, max_tokens=5))
    finally:
        runner.close()
    exp = Experience.from_samples(samples, tok.pad_token_id)
    trainer = ReferenceWorker.from_config(copy.deepcopy(model), RunConfig())
    recomputed = trainer.compute_logprobs(exp)
    mask = exp.response_mask.bool()
    assert int((~mask & (exp.batch.attention_mask[:, exp.batch.prompt_width :] > 0)).sum()) > 0
    torch.testing.assert_close(recomputed[mask], exp.behaviour_logprobs[mask], atol=1e-5, rtol=0)
    assert recomputed[~mask].abs().sum() == 0  # observation tokens: never a logprob


def test_versions_exact_across_an_interrupt_in_the_middle_of_turn_2(tiny):
    model, tok = tiny
    engine = make_engine(copy.deepcopy(model), tok, max_slots=2)
    runner = runner_for(engine, tok, lambda: scripted_env(99), max_turns=3, max_turn_tokens=8)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    reqs = [
        GenerationRequest(
            [1], SamplingParams(max_tokens=8, seed=5, ignore_eos=True), metadata={"prompt": "7*8="}
        )
    ]
    try:
        runner.submit_many(reqs)
        ep = next(iter(runner._episodes.values()))
        deadline = time.monotonic() + 60
        # drive until turn 2 has generated 3 of its 8 tokens
        while True:
            runner.poll(0.0)
            running = list(engine.scheduler.running.values())
            if ep.builder is not None and ep.builder.turns == 1 and running:
                if running[0].num_generated >= 3:
                    break
            assert time.monotonic() < deadline
        runner.update_weights(new, version=1, interrupt=True)
        out = []
        while not out:
            out = runner.poll(0.05)
            assert time.monotonic() < deadline
    finally:
        runner.close()
    (s,) = out
    assert s.metadata["env"]["stop_reason"] == "max_turns" and s.num_interrupts == 1
    mask, v = s.loss_mask, s.versions
    model_versions = [x for x, m in zip(v, mask, strict=True) if m]
    assert len(model_versions) == 24
    assert model_versions[:8] == [0] * 8  # turn 1
    assert model_versions[8:16] == [0] * 3 + [1] * 5  # turn 2: interrupted after 3 tokens
    assert model_versions[16:] == [1] * 8  # turn 3: new weights


class Raising(Environment):
    def __init__(self, where: str):
        self.where = where

    async def reset(self, row):
        if self.where == "reset":
            raise EnvError("reset exploded")
        if self.where == "malformed":
            return [{"role": "user", "content": 42}]
        return [{"role": "user", "content": "1+1="}]

    async def step(self, message):
        if self.where == "step":
            raise RuntimeError("step exploded")
        if self.where == "hang":
            await asyncio.sleep(30)
        if self.where == "overflow":
            return StepResult([{"role": "tool", "content": "x" * 300}])
        if self.where == "bad_step":
            return 7
        if self.where == "tool":  # the model's turn as a bad tool call (bad JSON, unknown tool)
            tool_env = ToolEnvironment([])
            text = '<tool_call>{"name": "calc"</tool_call><tool_call>{"name": "nope"}</tool_call>'
            return await tool_env.step({"role": "assistant", "content": text})
        return StepResult(done=True)

    async def close(self):
        if self.where == "close":
            raise RuntimeError("close exploded")


@pytest.mark.parametrize(
    "where, stop",
    [
        ("reset", "env_error"),
        ("malformed", "env_error"),
        ("step", "env_error"),
        ("bad_step", "env_error"),
        ("hang", "timeout"),
        ("overflow", "context_overflow"),
        ("tool", "max_turns"),
        ("close", "env_done"),
    ],
)
def test_environment_failures_are_recorded_outcomes_and_the_run_goes_on(tiny, where, stop):
    model, tok = tiny
    calls = {"n": 0}

    def factory():
        calls["n"] += 1  # episodes 0 and 2 fail, 1 and 3 are healthy
        return Raising(where) if calls["n"] % 2 else Raising("none")

    runner = runner_for(
        make_engine(model, tok, max_slots=4),
        tok,
        factory,
        max_turns=2,
        step_timeout_s=0.5,
        reuse=False,
        concurrency=1,
    )
    try:
        t0 = time.monotonic()
        samples = runner.generate(requests(4))
        assert time.monotonic() - t0 < 20
        m = runner.env_metrics()
    finally:
        runner.close()
    reasons = [s.metadata["env"]["stop_reason"] for s in samples]
    assert reasons[0] == reasons[2] == stop
    assert reasons[1] == reasons[3] == "env_done"  # the healthy episodes are untouched
    assert m[f"env/stop_{stop}"] == (4 if stop == "env_done" else 2)
    failed = stop in ("env_error", "timeout")
    assert m.get("env/failures", 0) == (2 if failed else 0)
    scores = episode_scores(samples, torch.ones(4))
    for i in (0, 2):
        s = samples[i]
        if failed:
            assert s.error and s.finish_reason == "abort" and sum(s.loss_mask) == 0
            assert scores[i] == 0
            assert (
                where in s.error
                or "took longer" in s.error
                or "content of type" in s.error
                or "returned int" in s.error
            )
    if where == "tool":
        assert m["env/tool_calls"] == 8 and m["env/tool_errors"] == 8  # 2 per step, 2 steps
        assert "error: tool call 1 is not valid JSON" in tok.decode(samples[0].response_ids)
    if where == "close":
        assert runner.pool.counters["close_failures"] == 2
    if where == "overflow":
        assert sum(samples[0].loss_mask) >= 1  # the turn it took is kept and trained
    exp = Experience.from_samples(samples, tok.pad_token_id)  # every outcome packs
    assert exp.response_mask.shape[0] == 4


def test_token_budget_stops_an_episode(tiny):
    model, tok = tiny
    runner = runner_for(
        make_engine(model, tok),
        tok,
        lambda: scripted_env(99),
        max_total_tokens=20,
        max_turn_tokens=6,
    )
    try:
        (s,) = runner.generate(requests(1))
        m = runner.env_metrics()
    finally:
        runner.close()
    assert s.metadata["env"]["stop_reason"] == "token_budget"
    assert len(s.prompt_ids) + len(s.response_ids) <= 20
    assert m["env/stop_token_budget"] == 1


class Slow(Environment):
    """Every call waits ``delay`` seconds; tracks how many instances are in an episode."""

    active = 0
    max_active = 0

    def __init__(self, delay: float):
        self.delay = delay

    async def reset(self, row):
        Slow.active += 1
        Slow.max_active = max(Slow.max_active, Slow.active)
        await asyncio.sleep(self.delay)
        return [{"role": "user", "content": "1+2="}]

    async def step(self, message):
        await asyncio.sleep(self.delay)
        Slow.active -= 1
        return StepResult(done=True)


@pytest.mark.parametrize("concurrency, lo, hi", [(4, 0.0, 2.0), (1, 2.4, 30.0)])
def test_episodes_wait_on_environments_concurrently_up_to_the_pool_limit(tiny, concurrency, lo, hi):
    """4 episodes whose reset and step each take 0.3 s: side by side ~0.6 s of waiting in all,
    one at a time (concurrency 1) at least 4 x 0.6 s."""
    model, tok = tiny
    Slow.active = Slow.max_active = 0
    runner = runner_for(make_engine(model, tok), tok, lambda: Slow(0.3), concurrency=concurrency)
    try:
        t0 = time.monotonic()
        samples = runner.generate(requests(4, max_tokens=2))
        wall = time.monotonic() - t0
    finally:
        runner.close()
    assert [s.metadata["env"]["stop_reason"] for s in samples] == ["env_done"] * 4
    assert Slow.max_active == concurrency
    assert lo <= wall <= hi, wall
    assert runner.pool.counters["created"] == concurrency  # reused after each episode


def test_staleness_counts_trained_tokens_only():
    from collections import Counter

    from relayrl.controller.schedules import AsyncSchedule
    from relayrl.rollout import Sample

    s = Sample(0, [1], [5, 6, 7, 8], [0.0] * 4, [3, -50, -50, 3], "eos", loss_mask=[1, 0, 0, 1])
    exp = Experience.from_samples([s], pad_id=0)
    exp.advantages = torch.ones(1, 4)
    sched = AsyncSchedule.__new__(AsyncSchedule)
    sched.cfg = RunConfig.model_validate({"async": {"max_token_staleness": 2}})
    sched.staleness_hist = Counter()
    out = sched.bound_staleness(exp, step=4)
    assert out["staleness_max"] == 1 and out["stale_token_frac"] == 0.0
    assert sched.staleness_hist == Counter({1: 2})


def test_a_weight_update_between_turns_versions_the_next_turn(tiny):
    """The update lands while the episode waits on its environment after turn 1 (no
    interrupt): turn 1 stays version 0, turn 2 is generated by the new weights."""
    model, tok = tiny
    engine = make_engine(copy.deepcopy(model), tok, max_slots=2)

    async def slow_step(message, state):
        await asyncio.sleep(0.3)
        return StepResult([{"role": "tool", "content": "ok"}])

    def env():
        return FunctionEnvironment(lambda row, st: [{"role": "user", "content": "1="}], slow_step)

    runner = runner_for(engine, tok, env, max_turns=2, max_turn_tokens=4)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    req = GenerationRequest([1], SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
    try:
        runner.submit_many([req])
        ep = next(iter(runner._episodes.values()))
        deadline = time.monotonic() + 60
        while ep.builder is None or ep.builder.turns < 1:
            runner.poll(0.0)
            assert time.monotonic() < deadline
        assert not engine.scheduler.has_work()  # waiting on the environment, slot free
        runner.update_weights(new, version=1, interrupt=False)
        out = []
        while not out:
            out = runner.poll(0.05)
            assert time.monotonic() < deadline
    finally:
        runner.close()
    (s,) = out
    versions = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    assert versions == [0] * 4 + [1] * 4 and s.num_interrupts == 0


def test_a_hanging_sync_step_times_out_without_blocking(tiny):
    model, tok = tiny

    def hang(message, state):
        time.sleep(60)  # a blocking call in a plain function: runs in its own daemon thread
        return StepResult(done=True)

    def env():
        return FunctionEnvironment(lambda row, st: [{"role": "user", "content": "1="}], hang)

    runner = runner_for(make_engine(model, tok), tok, env, step_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        samples = runner.generate(requests(2, max_tokens=2))
        assert time.monotonic() - t0 < 30  # the 0.3 s step timeout, not the 60 s hang
    finally:
        runner.close()
    assert [s.metadata["env"]["stop_reason"] for s in samples] == ["timeout"] * 2
    assert "step took longer than 0.3 s" in samples[0].error


def test_env_loop_stop_cancels_what_still_runs():
    """A run that ends while episodes wait on their environments: stopping the loop cancels
    those calls (awaited to their cancellation) instead of leaving them pending."""
    from relayrl.env.pool import EnvLoop

    loop = EnvLoop()
    waiting = loop.submit(asyncio.sleep(30))
    t0 = time.perf_counter()
    loop.stop()
    assert waiting.cancelled()
    assert time.perf_counter() - t0 < 5
    assert loop.loop.is_closed()

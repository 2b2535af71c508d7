"""The typed seams (issue 40 item 4): every rollout backend that builds on the CPU is a
``RolloutBackend`` and exactly one of ``SteppingEngine`` / ``PollingBackend``, the wrappers
implement the members themselves (no forwarding of unknown names to the engine), and the reward
role is a ``Scorer``. Behaviour through the protocol members is checked alongside."""

from __future__ import annotations

import pytest
import torch

from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.env import FunctionEnvironment, PlainRenderer, StepResult
from relayrl.env.agent_rollout import AgentRollout
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import EpisodeScorer
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.reward import BatchScorer, Scorer
from relayrl.reward.service.rm_scorer import MixedReward
from relayrl.rollout import (
    EngineReport,
    EpisodeMetrics,
    GenerationRequest,
    LivePollingBackend,
    PollingBackend,
    RolloutBackend,
    RolloutEngine,
    SamplingParams,
    SteppingEngine,
    driven,
)
from relayrl.workers import RewardWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("seam") / "m", hidden_size=32, seed=5)
    return path, load_causal_lm(path).eval(), load_tokenizer(path)


def _engine(model, tok) -> RolloutEngine:
    return RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=3
    )


def _requests(tok, n: int = 2, max_tokens: int = 4) -> list[GenerationRequest]:
    ids = tok("1+2=")["input_ids"]
    return [
        GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, seed=i), group_id=0)
        for i in range(n)
    ]


def _kinds(backend: object) -> tuple[bool, bool, bool]:
    return (
        isinstance(backend, RolloutBackend),
        isinstance(backend, SteppingEngine),
        isinstance(backend, PollingBackend),
    )


def test_the_own_engine_is_a_stepping_backend(tiny) -> None:
    _, model, tok = tiny
    engine = _engine(model, tok)
    assert _kinds(engine) == (True, True, False)
    assert driven(engine) is engine
    assert engine.max_slots == 3 and engine.max_model_len == model.config.max_position_embeddings
    samples = engine.generate(_requests(tok))
    assert all(s.versions == [0] * len(s.response_ids) for s in samples)
    engine.update_weights(model.state_dict(), version=1)
    assert engine.version == 1
    rid = engine.submit(_requests(tok, 1, max_tokens=8)[0])
    engine.step()
    ids, logprobs, versions = engine.progress(rid) or ([], [], [])
    assert len(ids) == len(logprobs) == len(versions) == 1 and versions == [1]
    assert engine.abort(rid) and engine.step()[0].finish_reason == "abort"
    assert isinstance(engine.report(), EngineReport)
    engine.close()  # nothing to stop: a no-op, and the engine still generates
    assert len(engine.generate(_requests(tok, 1))) == 1


def _env() -> FunctionEnvironment:
    def reset(row, state):
        return [{"role": "user", "content": "1+2="}]

    def step(message, state):
        return StepResult(observation=[], reward=1.0, done=True)

    return FunctionEnvironment(reset, step)


def test_the_episode_runner_polls_and_implements_the_members_itself(tiny) -> None:
    _, model, tok = tiny
    engine = _engine(model, tok)
    limits = RunnerLimits(max_turns=2, max_model_len=128, step_timeout_s=20.0)
    runner = EpisodeRunner(engine, _env, PlainRenderer(tok), limits, concurrency=2)
    try:
        assert _kinds(runner) == (True, False, True)
        assert isinstance(runner, EpisodeMetrics) and not isinstance(engine, EpisodeMetrics)
        assert (runner.version, runner.max_slots, runner.max_model_len) == (
            0,
            3,
            engine.max_model_len,
        )
        with pytest.raises(AttributeError):  # no forwarding of the engine's other names
            runner.kv_cache  # noqa: B018
        samples = runner.generate(_requests(tok))
        assert [s.metadata["env"]["stop_reason"] for s in samples] == ["env_done"] * 2
        assert runner.env_metrics()["env/episodes"] == 2.0
        runner.update_weights(model.state_dict(), version=3, interrupt=False)
        assert runner.version == engine.version == 3
        assert runner.rejected() == []
        assert runner.report().counters["requests_finished"] >= 2
    finally:
        runner.close()


async def _no_call_agent(base_url: str, api_key: str, row: dict) -> float:
    return 0.5


def test_the_agent_rollout_polls_and_implements_the_members_itself(tiny) -> None:
    _, model, tok = tiny
    engine = _engine(model, tok)
    rollout = AgentRollout(engine, tok, _no_call_agent, timeout_s=10.0)
    try:
        assert _kinds(rollout) == (True, False, True)
        assert isinstance(rollout, EpisodeMetrics)
        assert (rollout.version, rollout.max_slots) == (0, 3)
        assert rollout.max_model_len == engine.max_model_len
        with pytest.raises(AttributeError):
            rollout.kv_cache  # noqa: B018
        rollout.prioritize([0])  # through the owner thread, on the engine
        rollout.update_weights(model.state_dict(), version=2)
        assert rollout.version == engine.version == 2
        assert rollout.rejected() == []
    finally:
        rollout.close()


def test_the_engine_process_client_polls(tiny) -> None:
    path, model, tok = tiny
    spec = EngineSpec(
        model_path=str(path),
        dtype="float32",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=2,
        threads=1,
        version=0,
        urgent_steps=0,
    )
    with EngineProcess(spec, model.state_dict()) as proc:
        assert _kinds(proc) == (True, False, True)
        assert isinstance(proc, LivePollingBackend)  # streams and aborts by the caller's key
        assert driven(proc) is proc
        assert (proc.max_slots, proc.max_model_len) == (2, None)  # the caller reads the config
        samples = proc.generate(_requests(tok))
        assert all(s.versions == [0] * len(s.response_ids) for s in samples)
        proc.submit_many([GenerationRequest([], SamplingParams(max_tokens=2), 0, {"k": 1})])
        proc.generate(_requests(tok, 1))  # the worker has read the bad request by now
        assert [req.metadata for req, _ in proc.rejected()] == [{"k": 1}]


def test_an_incomplete_backend_is_refused_with_its_name() -> None:
    class GenerateOnly:
        version = 0

        def generate(self, requests):
            return []

    assert not isinstance(GenerateOnly(), RolloutBackend)
    with pytest.raises(TypeError, match="GenerateOnly is neither a SteppingEngine"):
        driven(GenerateOnly())  # type: ignore[arg-type]


def _fn(prompt: str, completion: str, sample: dict) -> float:
    return float(len(completion) > 0)


def test_the_reward_roles_are_scorers(tiny) -> None:
    _, model, tok = tiny
    worker = RewardWorker(_fn, tok)
    episodes = EpisodeScorer(worker, "reward_fn", 0.0)
    assert isinstance(worker, Scorer) and isinstance(episodes, Scorer)
    assert episodes.fn is _fn and episodes.service is None
    with pytest.raises(AttributeError):  # no forwarding of the worker's other names
        episodes.tokenizer  # noqa: B018
    samples = _engine(model, tok).generate(_requests(tok))
    scores, _ = episodes.score(samples)
    assert episodes.progress() == worker.progress() == 2
    exact = torch.tensor([0.1, 0.7], dtype=torch.float64)
    assert worker.finish(samples, exact) is exact  # single-turn: the scores as they are
    assert torch.equal(episodes.finish(samples, scores), scores)
    assert episodes.decode(samples[0]) == worker.decode(samples[0])
    # a batched scorer is told from a plain function by the protocol
    assert isinstance(MixedReward([("f", _fn, 1.0)]), BatchScorer)
    assert not isinstance(_fn, BatchScorer)

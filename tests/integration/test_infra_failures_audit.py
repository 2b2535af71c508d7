"""Audit of "an infrastructure failure is never training data" (docs/failures.md), breaking
the real components rather than mocks of them.

- a single-turn request the engine aborts (mid-generation, as a server that drops a request
  does) or refuses (a bad request) comes back as an ``'abort'`` sample, scored 0 by the reward
  function: an infrastructure failure (``engine``), left out of the batch and retried, as an
  aborted turn of an episode is.
"""

from __future__ import annotations

import pytest

from relayrl.controller.failures import FailureLog, infra_cause, retry_failed
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.rollout.types import Sample
from relayrl.workers.reward import RewardWorker


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("audit") / "m", hidden_size=32, seed=5)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def _engine(model, tok, **kw) -> RolloutEngine:
    return RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def _request(tok, i: int, group: int = 0, max_tokens: int = 8) -> GenerationRequest:
    ids = tok.encode("12+3=", add_special_tokens=False)
    return GenerationRequest(
        ids,
        SamplingParams(max_tokens=max_tokens, seed=100 + i, ignore_eos=True),
        group_id=group,
        metadata={"prompt": "12+3=", "answer": "15", "sample_index": i},
    )


# ---------------------------------------------------------------- engine aborts, single turn


def test_a_single_turn_request_the_engine_aborts_is_not_trained(tiny):
    """Group of 3: two requests finish, one is aborted after 2 of its 8 tokens (the engine's
    ``abort``: what a vLLM server's own ``abort`` / unknown finish reason also maps to). The
    arithmetic reward scores its partial text 0 without an error; the failure log must still
    leave it out (cause ``engine``) and the group's statistics are over the 2 survivors."""
    model, tok = tiny
    engine = _engine(model, tok, max_slots=4)
    ids = [engine.submit(_request(tok, i)) for i in range(3)]
    finished: list[Sample] = []
    while len((engine.progress(ids[2]) or ([],))[0]) < 2:  # waiting until it runs
        finished += engine.step()
    assert engine.abort(ids[2])
    finished += engine.drain()
    samples = sorted(finished, key=lambda s: s.metadata["sample_index"])
    assert [s.finish_reason for s in samples] == ["length", "length", "abort"]
    assert len(samples[2].response_ids) >= 2  # tokens of an interrupted generation
    scores, _ = RewardWorker(_always_one, tok).score(samples)
    assert scores.tolist() == [1.0, 1.0, 1.0]  # a reward that would have trained it
    assert infra_cause(samples[2]) == "engine"
    log = FailureLog()
    kept, kept_scores = log.admit(samples, scores)
    assert kept == samples[:2] and kept_scores.tolist() == [1.0, 1.0]
    m = log.metrics()
    assert m["failures/infra/engine"] == 1 and m["failures/infra"] == 1
    assert samples[2].metadata["failure"]["cause"] == "engine"


def _always_one(prompt: str, completion: str, sample: dict) -> float:
    return 1.0


def test_a_request_the_engine_refuses_is_retried_then_left_out(tiny):
    """``generate`` hands a bad request (a prompt past the context) back as an ``'abort'``
    sample with ``error`` set. It is retried (``failures.retries``) and, still refused, left
    out; the good samples train."""
    model, tok = tiny
    engine = _engine(model, tok, max_slots=4, max_model_len=16)
    bad = GenerationRequest(
        list(range(3, 23)),  # 20 prompt tokens > max_model_len 16
        SamplingParams(max_tokens=4, seed=7),
        group_id=0,
        metadata={"prompt": "x", "sample_index": 2},
    )
    requests = [_request(tok, 0, max_tokens=4), _request(tok, 1, max_tokens=4), bad]
    reward = RewardWorker(_always_one, tok)
    samples = engine.generate(requests)
    assert samples[2].finish_reason == "abort" and samples[2].error
    scores, _ = reward.score(samples)
    samples, scores, retried = retry_failed(engine, reward, requests, samples, scores, retries=2)
    assert retried == 2  # one failed sample, generated again twice
    assert infra_cause(samples[2]) == "engine"
    kept, _ = FailureLog().admit(samples, scores)
    assert kept == samples[:2]

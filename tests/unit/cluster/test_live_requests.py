"""The engine worker's streamed progress (:mod:`relayrl.cluster.live_requests`) with
``top_logprobs``: the worker's side (``WorkerStreams``) over a real ``RolloutEngine`` and the
client's (``ClientStreams``), without a process in between (the messages are pickled and
unpickled as the pipe does).

A streamed request that asks for alternatives gets them in its updates (a fifth element), and
the client's ``progress`` hands them out as a fourth element; joined, they are the sample's. A
request that does not ask sends the four-element update of before: its pickled message is
byte for byte the old format's."""

from __future__ import annotations

import pickle

import pytest
import torch

from relayrl.cluster.live_requests import ClientStreams, WorkerStreams, tag, untag
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from rollout_helpers import EOS, PAD, random_prompts, tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny_model(tmp_path_factory.mktemp("live"), "llama")


def test_alternatives_stream_with_the_tokens_and_cost_nothing_unasked(model):
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=2)
    worker, client = WorkerStreams(engine), ClientStreams()
    prompts = random_prompts([5, 7], seed=1)
    ks = {10: 3, 11: 0}  # key -> top_logprobs
    for key, prompt in zip(ks, prompts, strict=True):
        params = SamplingParams(
            max_tokens=9, seed=key, temperature=0.8, top_k=6, ignore_eos=True, top_logprobs=ks[key]
        )
        req = tag(GenerationRequest(prompt, params), key, stream=True)
        client.submitted(key)
        accepted = worker.submitted(req, engine.submit(req))
        assert accepted == (key, [], [], [])
        client.add(pickle.loads(pickle.dumps([accepted])))
    samples = {}
    widths: dict[int, set[int]] = {10: set(), 11: set()}
    got: dict[int, tuple] = {}
    while engine.has_unfinished():
        finished = engine.step()
        updates = worker.updates()
        for u in updates:
            widths[u[0]].add(len(u))
            if u[0] == 11:  # unasked: the old message, byte for byte
                assert pickle.dumps(u) == pickle.dumps((u[0], list(u[1]), list(u[2]), list(u[3])))
        client.add(pickle.loads(pickle.dumps(updates)))
        for key in ks:
            p = client.progress(key)
            if p is not None:
                got[key] = p
        worker.finished(finished)
        for s in finished:
            samples[untag(s.metadata)] = s
    assert widths == {10: {5}, 11: {4}}
    asked, plain = samples[10], samples[11]
    assert plain.top_logprobs is None and len(got[11]) == 3
    ids, lps, vs, tops = got[10]
    # the last step's tokens come with the sample only (its update is sent after it left)
    n = len(ids)
    assert 0 < n <= len(asked.response_ids)
    assert ids == asked.response_ids[:n] and lps == asked.behaviour_logprobs[:n]
    assert vs == asked.versions[:n] and tops == asked.top_logprobs[:n]
    assert all(1 <= len(t) <= 3 for t in tops)
    start = client.progress(10, 2)
    assert start is not None and start[3] == tops[2:]

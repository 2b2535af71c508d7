"""Token-by-token streaming and abort through the engine-process client
(:mod:`relayrl.cluster.engine_process` with :mod:`relayrl.cluster.live_requests`): the
endpoint (official ``openai`` client, a real server) over an engine in its own worker process.

The first chunk leaves while the worker still generates the request (an observer on the
engine owner holds the finish until the client has a chunk: before this change the tokens only
came with the finished sample, and the hold timed out); joined, the streamed text and ids are
the unstreamed reply's; a client that goes away mid-stream has its request aborted in the
worker (the worker is stopped with SIGSTOP while the client leaves, so the request cannot end
on its own meanwhile) and its slot freed; the worker's rejection is a 400 before the stream;
``submit_live`` / ``progress`` / ``abort`` on the client directly.

The set-up and the checks ``check_*`` are tests/support/openai_stream_checks.py's, shared with
tests/unit/env/test_openai_stream_tokens.py (the in-process engine) and
tests/integration/test_vllm_stream.py (the vLLM backend).
"""

from __future__ import annotations

import time

import pytest

from openai_stream_checks import (
    LONG,
    check_disconnect_aborts,
    check_first_chunk_before_finish,
    check_rejected_before_stream,
    check_streamed_equals_unstreamed,
    check_top_logprobs,
    check_top_logprobs_while_generating,
    client,
    collect,
    counters,
    process_server,
    serve,
    stop_process_server,
    stop_worker,
    stream_model,
)
from relayrl.rollout import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return stream_model(tmp_path_factory.mktemp("pstream"))


@pytest.fixture(scope="module")
def server(model_path):
    srv = process_server(model_path)
    yield srv
    stop_process_server(srv)


# ---------------------------------------------------------------------- the own engine
def test_the_first_chunk_arrives_while_the_worker_still_generates(server):
    assert server.owner.polling and server.owner.live
    # LONG, not 300: the worker once made all 300 tokens before the owner thread's first
    # poll (run after tests/unit/env/test_openai_stream_tokens.py's collection, every time),
    # and a reply that finishes within one poll reaches the client whole, at its finish
    check_first_chunk_before_finish(server, max_tokens=LONG)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_text_and_ids_equal_the_unstreamed_reply(server, chat):
    check_streamed_equals_unstreamed(server, chat)


def test_a_client_that_goes_away_has_its_request_aborted_in_the_worker(server):
    check_disconnect_aborts(server, *stop_worker(server))


def test_a_stop_string_aborts_the_rest_in_the_worker(server):
    # LONG, not 200: the worker must not reach the budget before the server's abort arrives
    kw = dict(model="p", max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True})
    full = client(server).completions.create(prompt="3+4=", **{**kw, "max_tokens": 40})
    stop = full.choices[0].text[20:22]
    cut = client(server).completions.create(prompt="3+4=", stop=stop, **kw)
    before = counters(server)
    stream = client(server).completions.create(prompt="3+4=", stop=stop, stream=True, **kw)
    got = collect(stream, chat=False)[0]
    assert (
        got["text"]
        == cut.choices[0].text
        == full.choices[0].text[: full.choices[0].text.index(stop)]
    )
    assert got["ids"] == cut.choices[0].model_extra["token_ids"] and got["finish"] == "stop"
    after = counters(server)
    assert after["requests_aborted"] == before["requests_aborted"] + 1


def test_top_logprobs_are_the_in_process_engines(server, model_path):
    """The worker keeps the alternatives (before: a 400): the same as the in-process engine's
    on the same model and seed, with the sample and the streamed chunks."""
    reference = serve(model_path)
    try:
        check_top_logprobs(server, reference)
    finally:
        reference.stop()


def test_top_logprobs_stream_while_the_worker_generates(server):
    check_top_logprobs_while_generating(server)


def test_a_request_the_worker_rejects_is_a_400_before_the_stream(server):
    check_rejected_before_stream(server)


def test_the_client_streams_and_aborts_live_requests_by_key(server):
    """``EngineProcess.submit_live`` directly (run on the owner thread, which it holds): the
    streamed request's progress grows while it runs, each read a prefix of its sample's tokens;
    it is aborted by its key once a read holds tokens (a budget of ``LONG``: a 30-token request
    once finished, accepted and streamed between two reads on a busy machine); the long
    non-streamed one is aborted once the streamed one's sample arrived; a key whose sample
    arrived is not sent."""
    short, long_ = 10**6, 10**6 + 1

    def drive(engine):
        assert engine.progress(short) is None  # not submitted
        greedy = dict(greedy=True, ignore_eos=True)
        engine.submit_live(
            GenerationRequest([5, 6, 7], SamplingParams(max_tokens=LONG, **greedy)), short
        )
        engine.submit_live(
            GenerationRequest([5, 6], SamplingParams(max_tokens=LONG, **greedy)),
            long_,
            stream=False,
        )
        seen, samples, sent = [], {}, False
        deadline = time.monotonic() + 120
        while len(samples) < 2 and time.monotonic() < deadline:
            p = engine.progress(short)
            if p is not None:
                seen.append(p[0])
                if p[0] and not sent:
                    sent = engine.abort(short)
            assert engine.progress(long_) is None  # not streamed
            for s in engine.poll(timeout=0.01):
                samples[len(s.prompt_ids)] = s
                if len(s.prompt_ids) == 3:
                    assert engine.abort(long_)
        assert not engine.abort(long_) and not engine.abort(short)
        assert engine.progress(short) is None
        return seen, samples

    seen, samples = server.owner.call(drive, timeout=180)
    ids = samples[3].response_ids
    assert samples[3].finish_reason == "abort" and 0 < len(ids) < LONG
    assert any(seen) and all(ids[: len(x)] == x for x in seen)  # each read: a prefix
    assert samples[2].finish_reason == "abort" and len(samples[2].response_ids) < LONG
    assert not any(k.startswith("_live") for s in samples.values() for k in s.metadata)

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

The helpers ``check_*`` are shared with tests/integration/test_vllm_stream.py (the vLLM backend).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.env.openai_server import OpenAIServer
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, SamplingParams

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LONG = 1000  # a budget the tiny model does not finish while the test stops its worker


def process_server(path: Path, backend: str = "own", slots: int = 4, **spec_kw) -> OpenAIServer:
    """An endpoint over an ``EngineProcess`` on the model at ``path`` (chat template above)."""
    tok = load_tokenizer(path)
    tok.chat_template = TEMPLATE
    spec = EngineSpec(
        model_path=str(path),
        dtype="float32",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=slots,
        threads=1,
        version=0,
        urgent_steps=0,
        backend=backend,
        **spec_kw,
    )
    engine = EngineProcess(spec, load_causal_lm(path, torch.float32).state_dict())
    srv = OpenAIServer(engine, tok)
    srv.start()
    return srv


def stop_process_server(srv: OpenAIServer) -> None:
    srv.stop()
    srv.owner.engine.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(
        tmp_path_factory.mktemp("pstream") / "m", hidden_size=32, max_position_embeddings=2048
    )
    srv = process_server(path)
    yield srv
    stop_process_server(srv)


def client(srv, session=None):
    key = session.key if session is not None else "EMPTY"
    return openai.OpenAI(base_url=srv.base_url(session), api_key=key, max_retries=0, timeout=120)


def collect(stream, chat: bool = True) -> dict:
    """Per choice index: joined text, token ids, per-chunk token counts, finish reason."""
    out: dict = {}
    for chunk in stream:
        for ch in chunk.choices:
            c = out.setdefault(ch.index, {"text": "", "ids": [], "n": []})
            c["text"] += (ch.delta.content or "") if chat else ch.text
            ids = (ch.model_extra or {}).get("token_ids") or []
            if ids:
                c["n"].append(len(ids))
            c["ids"] += ids
            c["finish"] = ch.finish_reason or c.get("finish")
    return out


def counters(srv) -> dict:
    return srv.owner.call(lambda e: e.report().counters)


# ---------------------------------------------------------------------- shared checks
def check_first_chunk_before_finish(srv, max_tokens: int = 300) -> None:
    """The observer runs on the owner thread when the finished sample arrives and holds it
    until the client has a chunk with tokens: it can only see one if chunks left before the
    finish (tokens only at the finish: the wait times out, ``seen == [False]``)."""
    session = srv.open_session()
    got, seen = threading.Event(), []

    def on_finish(sample):
        if sample.metadata.get("session") == session.key:
            seen.append(got.wait(60))

    srv.owner.observe(on_finish)
    try:
        stream = client(srv, session).chat.completions.create(
            model="p",
            messages=[{"role": "user", "content": "12+3="}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        counts = []
        for chunk in stream:
            for ch in chunk.choices:
                n = len((ch.model_extra or {}).get("token_ids") or [])
                if n:
                    counts.append(n)
                    got.set()
    finally:
        srv.owner.observers.remove(on_finish)
    assert seen == [True]
    assert len(counts) > 1 and sum(counts) == max_tokens
    assert session.calls[0].completion_ids and len(session.calls[0].completion_ids) == max_tokens


def check_streamed_equals_unstreamed(srv, chat: bool) -> None:
    kw = dict(model="p", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    session = srv.open_session()
    if chat:
        ask = dict(messages=[{"role": "user", "content": "7*8="}])
        plain = client(srv).chat.completions.create(**ask, **kw)
        got = collect(client(srv, session).chat.completions.create(**ask, stream=True, **kw))[0]
        want = plain.choices[0].message.content
    else:
        plain = client(srv).completions.create(prompt="7*8=", **kw)
        stream = client(srv, session).completions.create(prompt="7*8=", stream=True, **kw)
        got = collect(stream, chat=False)[0]
        want = plain.choices[0].text
    assert len(want) > 10 and got["text"] == want
    assert got["ids"] == plain.choices[0].model_extra["token_ids"] and got["n"]
    assert got["ids"] == session.calls[0].completion_ids
    assert got["finish"] == plain.choices[0].finish_reason == "length"


def check_disconnect_aborts_in_the_worker(srv, hold, resume) -> None:
    """The client reads a few tokens; ``hold()`` stops the engine (it cannot finish the
    request meanwhile); the client closes; once the server asked for the abort, ``resume()``:
    the request comes out aborted with its tokens so far, nothing is recorded, no slot stays
    taken."""
    session = srv.open_session()
    finished: queue.Queue = queue.Queue()

    def on_finish(sample):
        if sample.metadata.get("session") == session.key:
            finished.put(sample)

    srv.owner.observe(on_finish)
    before = counters(srv)
    aborts = srv.owner.aborts_requested
    held = False
    try:
        stream = client(srv, session).completions.create(
            model="p",
            prompt="9+9=",
            max_tokens=LONG,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        for chunk in stream:
            n += len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
            if n >= 3:
                break
        hold()
        held = True
        stream.close()
        for _ in range(600):  # the server noticed the disconnect and asked for the abort
            if srv.owner.aborts_requested > aborts:
                break
            time.sleep(0.1)
        resume()
        held = False
        sample = finished.get(timeout=60)
    finally:
        if held:
            resume()
        srv.owner.observers.remove(on_finish)
    assert srv.owner.aborts_requested == aborts + 1
    assert sample.finish_reason == "abort" and 3 <= len(sample.response_ids) < LONG
    assert not any(k.startswith("_live") for k in sample.metadata)
    after = counters(srv)
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["num_running"] == 0 and session.calls == []


def stop_worker(srv):
    """(hold, resume): SIGSTOP / SIGCONT the engine worker process."""
    pid = srv.owner.engine.pid
    return (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT))


# ---------------------------------------------------------------------- the own engine
def test_the_first_chunk_arrives_while_the_worker_still_generates(server):
    assert server.owner.polling and server.owner.live
    check_first_chunk_before_finish(server)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_text_and_ids_equal_the_unstreamed_reply(server, chat):
    check_streamed_equals_unstreamed(server, chat)


def test_a_client_that_goes_away_has_its_request_aborted_in_the_worker(server):
    check_disconnect_aborts_in_the_worker(server, *stop_worker(server))


def test_a_stop_string_aborts_the_rest_in_the_worker(server):
    kw = dict(model="p", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
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


def test_a_request_the_worker_rejects_is_a_400_before_the_stream(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model="p", prompt=[10**6], max_tokens=2, stream=True)
    assert "vocabulary" in e.value.body["message"]


def test_the_client_streams_and_aborts_live_requests_by_key(server):
    """``EngineProcess.submit_live`` directly (run on the owner thread, which it holds): the
    streamed request's progress grows to its sample's tokens; the long non-streamed one is
    aborted by its key once the short one finished; a key whose sample arrived is not sent."""
    short, long_ = 10**6, 10**6 + 1

    def drive(engine):
        assert engine.progress(short) is None  # not submitted
        greedy = dict(greedy=True, ignore_eos=True)
        engine.submit_live(
            GenerationRequest([5, 6, 7], SamplingParams(max_tokens=30, **greedy)), short
        )
        engine.submit_live(
            GenerationRequest([5, 6], SamplingParams(max_tokens=LONG, **greedy)),
            long_,
            stream=False,
        )
        seen, samples = [], {}
        deadline = time.monotonic() + 120
        while len(samples) < 2 and time.monotonic() < deadline:
            p = engine.progress(short)
            if p is not None:
                seen.append(p[0])
            assert engine.progress(long_) is None  # not streamed
            for s in engine.poll(timeout=0.01):
                samples[len(s.prompt_ids)] = s
                if len(s.prompt_ids) == 3:
                    assert engine.abort(long_)
        assert not engine.abort(long_) and engine.progress(short) is None
        return seen, samples

    seen, samples = server.owner.call(drive, timeout=180)
    ids = samples[3].response_ids
    assert samples[3].finish_reason == "length" and len(ids) == 30
    assert seen and all(ids[: len(x)] == x for x in seen)  # each read: a prefix of the reply
    assert samples[2].finish_reason == "abort" and len(samples[2].response_ids) < LONG
    assert not any(k.startswith("_live") for s in samples.values() for k in s.metadata)

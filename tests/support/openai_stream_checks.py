"""Shared set-up and checks for the token-by-token streaming tests of the OpenAI endpoint
(``relayrl.env.openai_stream``): the in-process engine
(tests/unit/env/test_openai_stream_tokens.py), an engine worker process
(tests/integration/test_openai_stream_process.py) and the vLLM backend
(tests/integration/test_vllm_stream.py).

Servers: :func:`serve` (a ``RolloutEngine`` in this process), :func:`process_server` (an
``EngineProcess``), both on a model from :func:`stream_model`. Client side: :func:`client` (the
official ``openai`` client, on a session's URL when given one) and :func:`collect` (a stream
joined per choice). Checks ``check_*``: one assertion set each, run against any of the servers.
"""

from __future__ import annotations

import copy
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from relayrl.cluster.engine_process import EngineProcess, EngineSpec
from relayrl.env.openai_server import OpenAIServer
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import RolloutEngine

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LONG = 1000  # a budget the tiny model does not finish while a test holds its engine


# ---------------------------------------------------------------------- servers
def stream_model(root: Path) -> Path:
    """The tiny model the streaming tests serve (2048 positions: room for ``LONG``)."""
    return build_tiny_model(root / "m", hidden_size=32, max_position_embeddings=2048)


def template_tokenizer(path: Path, template: str | None = TEMPLATE) -> Any:
    """The tokenizer at ``path`` with ``template`` as its chat template (None: as saved)."""
    tok = load_tokenizer(path)
    if template is not None:
        tok.chat_template = template
    return tok


def serve(path: Path, template: str | None = TEMPLATE, slots: int = 4) -> OpenAIServer:
    """A started endpoint over a ``RolloutEngine`` in this process on the model at ``path``."""
    tok = template_tokenizer(path, template)
    engine = RolloutEngine(
        copy.deepcopy(load_causal_lm(path)),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=slots,
    )
    srv = OpenAIServer(engine, tok)
    srv.start()
    return srv


def process_server(
    path: Path, backend: str = "own", slots: int = 4, **spec_kw: Any
) -> OpenAIServer:
    """A started endpoint over an ``EngineProcess`` on the model at ``path`` (``TEMPLATE``)."""
    tok = template_tokenizer(path)
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


# ---------------------------------------------------------------------- the client side
def client(srv: OpenAIServer, session: Any = None) -> openai.OpenAI:
    """The official client on ``srv`` (on ``session``'s URL and key when given)."""
    key = session.key if session is not None else "EMPTY"
    return openai.OpenAI(base_url=srv.base_url(session), api_key=key, max_retries=0, timeout=120)


def collect(stream: Iterable[Any], chat: bool = True) -> dict[int, dict[str, Any]]:
    """Per choice index: joined ``text``, token ``ids``, ``vs`` (versions), ``n`` (per-chunk
    token counts), ``lps`` (chat logprobs), ``finish``, and the last ``tool_calls`` delta."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for ch in chunk.choices:
            c = out.setdefault(ch.index, {"text": "", "ids": [], "vs": [], "n": [], "lps": []})
            c["text"] += (ch.delta.content or "") if chat else ch.text
            extra = ch.model_extra or {}
            ids = extra.get("token_ids") or []
            if ids:
                c["n"].append(len(ids))
            c["ids"] += ids
            c["vs"] += extra.get("versions") or []
            if chat and ch.logprobs is not None and ch.logprobs.content:
                c["lps"] += [x.logprob for x in ch.logprobs.content]
            c["finish"] = ch.finish_reason or c.get("finish")
            if chat and ch.delta.tool_calls:
                c["tool_calls"] = ch.delta.tool_calls
    return out


def counters(srv: OpenAIServer) -> dict[str, Any]:
    """The engine's counters, read on the owner thread."""
    return srv.owner.call(lambda e: e.report().counters)


# ---------------------------------------------------------------------- holding the engine
def stop_worker(srv: OpenAIServer) -> tuple[Callable[[], None], Callable[[], None]]:
    """(hold, resume): SIGSTOP / SIGCONT the engine worker process."""
    pid = srv.owner.engine.pid
    return (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT))


def hold_engine(
    srv: OpenAIServer, running: int | None = None
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(hold, resume) for an engine in this process: a call on the owner thread that waits.
    With ``running``, ``hold`` also asserts the engine had that many requests running."""
    held, release = threading.Event(), threading.Event()
    holder: list[threading.Thread] = []
    seen: list[int] = []

    def block(engine: Any) -> None:
        if running is not None:
            seen.append(engine.stats()["num_running"])
        held.set()
        release.wait(60)

    def hold() -> None:
        t = threading.Thread(target=srv.owner.call, args=(block,))
        t.start()
        holder.append(t)
        assert held.wait(60)
        if running is not None:
            assert seen == [running]

    def resume() -> None:
        release.set()
        if holder:
            holder[0].join(60)

    return hold, resume


# ---------------------------------------------------------------------- shared checks
def check_first_chunk_before_finish(srv: OpenAIServer, max_tokens: int = 300) -> None:
    """The observer runs on the owner thread when the finished sample arrives and holds it
    until the client has a chunk with tokens: it can only see one if chunks left before the
    finish (tokens only at the finish: the wait times out, ``seen == [False]``)."""
    session = srv.open_session()
    got, seen = threading.Event(), []

    def on_finish(sample: Any) -> None:
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
    assert len(counts) > 1 and sum(counts) == max_tokens  # many chunks, each with new tokens
    assert session.calls[0].completion_ids and len(session.calls[0].completion_ids) == max_tokens


def check_streamed_equals_unstreamed(srv: OpenAIServer, chat: bool, logprobs: bool = False) -> None:
    """Greedy, 60 tokens: the joined stream (text, ids, finish; with ``logprobs``, the chat
    logprobs) is the unstreamed reply, and its ids are the ones the session recorded."""
    kw: dict[str, Any] = dict(
        model="p", max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
    )
    session = srv.open_session()
    if chat:
        ask: dict[str, Any] = dict(messages=[{"role": "user", "content": "7*8="}])
        if logprobs:
            ask["logprobs"] = True
        plain = client(srv).chat.completions.create(**ask, **kw)
        got = collect(client(srv, session).chat.completions.create(**ask, stream=True, **kw))[0]
        want = plain.choices[0].message.content
        if logprobs:
            assert got["lps"] == [x.logprob for x in plain.choices[0].logprobs.content]
    else:
        plain = client(srv).completions.create(prompt="7*8=", **kw)
        stream = client(srv, session).completions.create(prompt="7*8=", stream=True, **kw)
        got = collect(stream, chat=False)[0]
        want = plain.choices[0].text
    assert len(want) > 10 and got["text"] == want
    assert got["ids"] == plain.choices[0].model_extra["token_ids"] and got["n"]
    assert got["ids"] == session.calls[0].completion_ids
    assert got["finish"] == plain.choices[0].finish_reason == "length"


def check_disconnect_aborts(
    srv: OpenAIServer, hold: Callable[[], None], resume: Callable[[], None]
) -> None:
    """The client reads a few tokens; ``hold()`` stops the engine (it cannot finish the
    request meanwhile); the client closes; once the server asked for the abort, ``resume()``:
    the request comes out aborted with its tokens so far, nothing is recorded, no slot stays
    taken."""
    session = srv.open_session()
    finished: queue.Queue = queue.Queue()

    def on_finish(sample: Any) -> None:
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
        held = True  # from here on, resume() is due even if hold() fails halfway
        hold()
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


def check_rejected_before_stream(srv: OpenAIServer) -> None:
    """A prompt id outside the vocabulary: a 400 naming it, before any chunk."""
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).completions.create(model="p", prompt=[10**6], max_tokens=2, stream=True)
    assert "vocabulary" in e.value.body["message"]


# ---------------------------------------------------------------------- top_logprobs
TOP_ASK: dict[str, Any] = dict(
    model="p",
    max_tokens=40,
    temperature=0.8,
    seed=5,
    extra_body={"ignore_eos": True, "top_k": 3},
)
"""A sampled request whose distribution keeps 3 tokens (``top_k``): 3 alternatives list all of
it, so their probabilities sum to 1 under the distribution sampled from (the raw model's 3
best, vLLM's default, hold less: a random tiny model spreads its mass)."""


def _chat_entries(content: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]


def _close(a: list[Any], b: list[Any], tol: float) -> None:
    """Equal chat entries, logprobs within ``tol`` (another process's float ops)."""
    assert [(t, [x for x, _ in alts]) for t, _, alts in a] == [
        (t, [x for x, _ in alts]) for t, _, alts in b
    ]
    va = [v for _, lp, alts in a for v in (lp, *(x for _, x in alts))]
    vb = [v for _, lp, alts in b for v in (lp, *(x for _, x in alts))]
    assert va == pytest.approx(vb, abs=tol)


def check_top_logprobs(srv: OpenAIServer, reference: OpenAIServer | None = None) -> None:
    """Chat ``top_logprobs=3`` (``TOP_ASK``): every token lists 1-3 alternatives, most likely
    first, summing to probability 1 (the distribution sampled from), the sampled token among
    them at its behaviour logprob; asking changes no token and no logprob; streamed = unstreamed
    (each chunk's tokens with their alternatives); completions ``logprobs=3`` the same way.
    With ``reference`` (the in-process engine on the same model) the same tokens and
    alternatives, within 1e-5."""
    msgs = [{"role": "user", "content": "5+6="}]
    c = client(srv)
    top = c.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=3, **TOP_ASK)
    entries = _chat_entries(top.choices[0].logprobs.content)
    assert len(entries) == TOP_ASK["max_tokens"]
    for tok, lp, alts in entries:
        assert 1 <= len(alts) <= 3 and (tok, lp) in alts
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
        assert sum(math.exp(v) for _, v in alts) == pytest.approx(1.0, abs=1e-4)
    plain = c.chat.completions.create(messages=msgs, logprobs=True, **TOP_ASK).choices[0]
    assert plain.model_extra["token_ids"] == top.choices[0].model_extra["token_ids"]
    assert [e.logprob for e in plain.logprobs.content] == [lp for _, lp, _ in entries]
    assert all(e.top_logprobs == [] for e in plain.logprobs.content)
    streamed = []
    stream = c.chat.completions.create(
        messages=msgs, logprobs=True, top_logprobs=3, stream=True, **TOP_ASK
    )
    for chunk in stream:
        for ch in chunk.choices:
            ids = (ch.model_extra or {}).get("token_ids") or []
            got = _chat_entries(ch.logprobs.content) if ch.logprobs is not None else []
            assert len(got) == len(ids) and all(alts for _, _, alts in got)
            streamed += got
    assert streamed == entries
    done = c.completions.create(prompt="5+6=", logprobs=3, **TOP_ASK).choices[0].logprobs
    assert len(done.top_logprobs) == TOP_ASK["max_tokens"]
    assert all(1 <= len(t) <= 3 for t in done.top_logprobs)
    tops: list[dict[str, float]] = []
    for chunk in c.completions.create(prompt="5+6=", logprobs=3, stream=True, **TOP_ASK):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tops += chunk.choices[0].logprobs.top_logprobs
    assert tops == done.top_logprobs
    if reference is not None:
        ref = client(reference).chat.completions.create(
            messages=msgs, logprobs=True, top_logprobs=3, **TOP_ASK
        )
        assert ref.choices[0].model_extra["token_ids"] == top.choices[0].model_extra["token_ids"]
        _close(_chat_entries(ref.choices[0].logprobs.content), entries, 1e-5)


def check_top_logprobs_while_generating(srv: OpenAIServer) -> None:
    """A ``LONG`` streamed request with ``top_logprobs=2``: its first chunks, read while it
    still generates (then the client leaves), carry each token's alternatives."""
    stream = client(srv).chat.completions.create(
        messages=[{"role": "user", "content": "1+1="}],
        logprobs=True,
        top_logprobs=2,
        stream=True,
        **{**TOP_ASK, "max_tokens": LONG},
    )
    n = 0
    with stream:
        for chunk in stream:
            for ch in chunk.choices:
                ids = (ch.model_extra or {}).get("token_ids") or []
                if ids:
                    assert ch.finish_reason is None
                    got = _chat_entries(ch.logprobs.content)
                    assert len(got) == len(ids) and all(1 <= len(a) <= 2 for _, _, a in got)
                    n += len(ids)
            if n >= 3:
                break
    assert n >= 3

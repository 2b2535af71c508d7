"""Streaming and the Responses API through the official ``openai`` client: the streamed
tokens are the recorded ones (chat and completions, also against the same call unstreamed),
a Responses API agent's function calls round-trip, and parameters the endpoint does not honour
are refused with 400 naming them."""

from __future__ import annotations

import copy
import json

import openai
import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env.openai_server import OpenAIServer
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import RolloutEngine

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("stream") / "m", hidden_size=32)
    tok = load_tokenizer(path)
    tok.chat_template = TEMPLATE
    model = load_causal_lm(path)
    engine = RolloutEngine(
        copy.deepcopy(model),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=4,
    )
    srv = OpenAIServer(engine, tok)
    srv.start()
    yield srv
    srv.stop()


def _client(srv, session=None):
    key = session.key if session is not None else "EMPTY"
    return openai.OpenAI(base_url=srv.base_url(session), api_key=key, max_retries=0, timeout=60)


def test_streamed_chat_tokens_are_the_recorded_ones(server):
    session = server.open_session()
    client = _client(server, session)
    msgs = [{"role": "user", "content": "12+3="}]
    stream = client.chat.completions.create(
        model="p",
        messages=msgs,
        max_tokens=8,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, ids, versions, finish, usage = "", [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            ids += (ch.model_extra or {}).get("token_ids", [])
            versions += (ch.model_extra or {}).get("versions", [])
            finish = ch.finish_reason or finish
    (call,) = session.calls
    assert ids == call.completion_ids and versions == call.versions and len(ids) >= 1
    assert usage.completion_tokens == len(ids) and finish in ("stop", "length")
    plain = _client(server).chat.completions.create(model="p", messages=msgs, max_tokens=8, seed=5)
    assert text == plain.choices[0].message.content  # the same call unstreamed
    assert plain.choices[0].model_extra["token_ids"] == ids


def test_streamed_completion_tokens_are_the_recorded_ones(server):
    session = server.open_session()
    stream = _client(server, session).completions.create(
        model="p", prompt="7+8=", max_tokens=6, seed=1, stream=True
    )
    text, ids = "", []
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.text
            ids += (ch.model_extra or {}).get("token_ids", [])
    (call,) = session.calls
    assert ids == call.completion_ids
    assert text == server.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_responses_api_text_reply_is_the_recorded_call(server):
    session = server.open_session()
    resp = _client(server, session).responses.create(
        model="p", input="12+3=", instructions="add", max_output_tokens=6
    )
    (call,) = session.calls
    assert resp.output_text == server.rendering.message(call.completion_ids, False)["content"]
    assert resp.usage.output_tokens == len(call.completion_ids)
    assert resp.model_extra["token_ids"] == call.completion_ids


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("logit_bias", {"5": 1}),
    ],
)
def test_parameters_not_honoured_are_refused(server, param, value):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(
            model="p",
            messages=[{"role": "user", "content": "x"}],
            tools=tools,
            max_tokens=2,
            **{param: value},
        )
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_echo_is_refused_on_completions(server):
    with pytest.raises(openai.BadRequestError):
        _client(server).completions.create(model="p", prompt="1", max_tokens=2, echo=True)


def test_a_responses_api_agent_calls_a_function_and_reads_its_output():
    """Qwen2.5 template, scripted replies: a function_call item, then (given its output) the
    answer; the second call's prompt holds the tool response where the template puts it."""
    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
    engine = ScriptedEngine(tok, [call, "408"])
    srv = OpenAIServer(engine, tok)
    srv.start()
    try:
        session = srv.open_session()
        client = _client(srv, session)
        tools = [
            {
                "type": "function",
                "name": "multiply",
                "description": "a*b",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            }
        ]
        items: list = [{"role": "user", "content": "12*34?"}]
        r1 = client.responses.create(model="p", input=items, tools=tools)
        (fc,) = [o for o in r1.output if o.type == "function_call"]
        assert fc.name == "multiply" and json.loads(fc.arguments) == {"a": 12, "b": 34}
        items += [
            fc.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": fc.call_id, "output": "408"},
        ]
        r2 = client.responses.create(model="p", input=items, tools=tools)
        assert r2.output_text == "408"
        assert "<tool_response>\n408\n</tool_response>" in tok.decode(session.calls[1].prompt_ids)
        assert session.prefix_breaks == 0  # turn 2 extends turn 1's tokens
    finally:
        srv.stop()

"""Token-by-token streaming (``relayrl.env.openai_stream``) through the official ``openai``
client against a real server on tiny models: the chunks leave while the engine still generates
the request (shown by an observer that holds the engine's finish until the client has a
chunk), joined they are the unstreamed reply (greedy and seeded, stop strings, ``n``,
logprobs, a byte-level BPE model whose tokens split characters, tool calls under a chat
template), a client that goes away mid-stream frees its engine slot (the request is aborted),
and the incremental decoder's deltas join to the full decode (hand-checked cases). The server
set-up and the ``check_*`` assertion sets are tests/support/openai_stream_checks.py's (shared with
tests/integration/test_openai_stream_process.py)."""

from __future__ import annotations

import random

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from helpers import byte_bpe_tokenizer
from openai_stream_checks import (
    check_disconnect_aborts,
    check_first_chunk_before_finish,
    check_rejected_before_stream,
    check_streamed_equals_unstreamed,
    client,
    collect,
    hold_engine,
    serve,
    stream_model,
)
from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env.openai_server import OpenAIServer
from relayrl.env.openai_stream import ChoiceText, IncrementalDecoder, held_suffix
from relayrl.model.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(stream_model(tmp_path_factory.mktemp("stream")))
    yield srv
    srv.stop()


# ---------------------------------------------------------------------- the decoder (by hand)
def test_decoder_deltas_join_to_the_decode_of_a_character_tokenizer():
    tok = build_char_tokenizer("abc +=")
    ids = tok("ab c+a", add_special_tokens=False)["input_ids"]
    dec = IncrementalDecoder(lambda x: tok.decode(x))
    deltas = [dec.push(t) for t in ids]
    assert deltas == ["a", "b", " ", "c", "+", "a"] and dec.flush() == ""


def test_decoder_holds_a_character_split_over_byte_tokens_until_it_is_whole():
    tok = byte_bpe_tokenizer()
    ids = tok("1é世", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6  # '1', then 2 + 3 single-byte tokens (never merged in training)
    dec = IncrementalDecoder(lambda x: tok.decode(x))
    assert [dec.push(t) for t in ids] == ["1", "", "é", "", "", "世"]
    dec = IncrementalDecoder(lambda x: tok.decode(x))
    assert [dec.push(t) for t in ids[:5]] == ["1", "", "é", "", ""]
    assert dec.flush() == tok.decode(ids[3:5])  # cut mid-character: as the full decode shows it


def test_decoder_deltas_equal_the_full_decode_on_random_byte_tokens():
    tok = byte_bpe_tokenizer()
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 40))]
        dec = IncrementalDecoder(lambda x: tok.decode(x))
        text = ""
        for k, t in enumerate(ids):
            text += dec.push(t)
            assert tok.decode(ids[: k + 1]).startswith(text)  # never ahead of the decode
        assert text + dec.flush() == tok.decode(ids)


def test_held_suffix_and_stop_strings_by_hand():
    assert held_suffix("abc</", ["</s>"]) == 2  # '</' may begin '</s>'
    assert held_suffix("abc<", ["</s>", "<tool_call>"]) == 1
    assert held_suffix("abc", ["</s>"]) == 0 and held_suffix("a</s", ["</s>"]) == 3
    tok = build_char_tokenizer("abcxy")
    st = ChoiceText(lambda x: tok.decode(x), ["xy"], hold_tags=False)
    got = []
    for ch in "abxaxyb":
        st.push(tok.convert_tokens_to_ids(ch))
        got.append(st.release())
        if st.stop_at is not None:
            break
    # 'x' is held (it may begin 'xy'), released when 'a' follows; 'xy' ends the text
    assert got == ["a", "b", "", "xa", "", ""] and st.sent == "abxa" and st.stop_at == 4


def test_tool_calls_under_a_template_are_held_with_the_whitespace_before_them():
    tok = qwen_tokenizer()
    st = ChoiceText(lambda x: tok.decode(x), [], hold_tags=True)
    text = 'Sure. \n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        st.push(t)
        st.release()
    assert st.sent == "Sure." and st.rest("Sure.") == ""


# ---------------------------------------------------------------------- through the server
def test_the_first_chunk_arrives_while_the_engine_still_generates(server):
    """The observer runs on the engine's thread when the request finishes, before its future
    resolves, and holds it until the client has a chunk with tokens: it can only see one if
    chunks left while the request was still generating (today's code before this change
    cut them from the finished call, and this wait timed out)."""
    check_first_chunk_before_finish(server, max_tokens=40)


@pytest.mark.parametrize("chat", [True, False])
def test_greedy_streamed_text_equals_the_unstreamed_reply(server, chat):
    check_streamed_equals_unstreamed(server, chat, logprobs=True)


def test_a_stop_string_cuts_the_stream_as_it_cuts_the_reply_and_frees_the_slot(server):
    oai = client(server)
    kw = dict(model="p", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(prompt="3+4=", **{**kw, "max_tokens": 40}).choices[0].text
    stop = full[20:22]  # two characters: the first is held until the second shows
    cut = oai.completions.create(prompt="3+4=", stop=stop, **kw)
    before = server.owner.call(lambda e: e.stats())
    session = server.open_session()
    got = collect(
        client(server, session).completions.create(prompt="3+4=", stop=stop, stream=True, **kw),
        chat=False,
    )[0]
    assert got["text"] == cut.choices[0].text == full[: full.index(stop)]
    assert got["ids"] == cut.choices[0].model_extra["token_ids"] == session.calls[0].completion_ids
    assert got["finish"] == "stop" == session.calls[0].finish_reason
    after = server.owner.call(lambda e: e.stats())  # aborted at the stop, not run to 200
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["tokens_generated"] - before["tokens_generated"] < 200


def test_n_seeded_choices_stream_as_their_unstreamed_replies(server):
    oai = client(server)
    kw = dict(model="p", messages=[{"role": "user", "content": "1+"}], max_tokens=12, seed=3, n=2)
    plain = oai.chat.completions.create(**kw)
    session = server.open_session()
    got = collect(
        client(server, session).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert sorted(got) == [0, 1]
    for ch in plain.choices:
        assert got[ch.index]["text"] == ch.message.content
        assert got[ch.index]["ids"] == ch.model_extra["token_ids"]
        assert got[ch.index]["ids"] == session.calls[ch.index].completion_ids


def test_a_client_that_goes_away_mid_stream_frees_its_engine_slot(server):
    """The engine is held (a call on its thread) once the client has tokens; the client
    closes; once the server asked for the abort the engine goes on: the request comes out
    aborted with its tokens so far, nothing is recorded, no slot stays taken."""
    check_disconnect_aborts(server, *hold_engine(server, running=1))


def test_a_request_the_engine_rejects_is_a_400_before_the_stream(server):
    check_rejected_before_stream(server)


def test_a_byte_level_bpe_model_streams_split_characters_whole(tmp_path):
    """A random GPT-2 on a byte-level BPE samples lone bytes: partial characters are held
    until whole (or sent as the full decode shows them), and the joined stream is the reply."""
    tok = byte_bpe_tokenizer()
    cfg = GPT2Config(
        n_positions=128,
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "g")
    tok.save_pretrained(tmp_path / "g")
    srv = serve(tmp_path / "g", template=None, slots=2)
    try:
        oai = client(srv)
        split = 0  # replies in which some token ends mid-character
        for seed in range(3):
            kw = dict(model="p", prompt="1+2=", max_tokens=50, seed=seed, temperature=1.5)
            plain = oai.completions.create(**kw)
            got = collect(oai.completions.create(stream=True, **kw), chat=False)[0]
            assert got["text"] == plain.choices[0].text
            assert got["ids"] == plain.choices[0].model_extra["token_ids"]
            ids = got["ids"]
            split += any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
        assert split >= 1
    finally:
        srv.stop()


def test_tool_calls_stream_as_one_delta_after_the_text_before_them():
    tok = qwen_tokenizer()
    reply = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    srv = OpenAIServer(ScriptedEngine(tok, [reply]), tok)
    srv.start()
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        kw = dict(model="p", messages=[{"role": "user", "content": "go"}], tools=tools)
        plain = client(srv).chat.completions.create(**kw)
        got = collect(client(srv).chat.completions.create(stream=True, **kw))[0]
        msg = plain.choices[0].message
        assert got["text"] == msg.content == "Sure." and got["finish"] == "tool_calls"
        (call,) = got["tool_calls"]
        assert call.function.name == "f" and call.function.arguments == '{"a": 1}'
        assert got["ids"] == plain.choices[0].model_extra["token_ids"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------- the Responses API
def _response_events(stream) -> tuple[list[str], str, object]:
    kinds, text, final = [], "", None
    for e in stream:
        kinds.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    return kinds, text, final


def test_a_streamed_response_is_the_unstreamed_one_delta_by_delta(server):
    oai = client(server)
    kw = dict(model="p", input="7*8=", instructions="add", max_output_tokens=30, temperature=0)
    plain = oai.responses.create(**kw)
    session = server.open_session()
    kinds, text, final = _response_events(
        client(server, session).responses.create(stream=True, **kw)
    )
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds and kinds[-1] == f"response.{plain.status}"
    assert text == plain.output_text == final.output_text and len(text) > 5
    assert final.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert final.model_extra["token_ids"] == session.calls[0].completion_ids
    assert final.id == "resp_" + session.calls[0].response_id.removeprefix("chatcmpl-")


def test_a_streamed_response_calls_a_function_as_the_unstreamed_one():
    tok = qwen_tokenizer()
    reply = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    srv = OpenAIServer(ScriptedEngine(tok, [reply]), tok)
    srv.start()
    try:
        tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
        kw = dict(model="p", input="go", tools=tools)
        plain = client(srv).responses.create(**kw)
        kinds, text, final = _response_events(client(srv).responses.create(stream=True, **kw))
        assert text == "" and "response.output_text.delta" not in kinds
        assert "response.function_call_arguments.done" in kinds and kinds[-1].endswith("completed")
        (want,) = plain.output
        (got,) = final.output
        assert (got.type, got.name, got.arguments) == ("function_call", "f", '{"a": 1}')
        assert (want.name, want.arguments) == (got.name, got.arguments)
    finally:
        srv.stop()

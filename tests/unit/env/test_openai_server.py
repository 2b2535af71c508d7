"""The OpenAI-compatible endpoint: a real uvicorn server, the official ``openai`` client, a
tiny random model. Tokens and logprobs must be the engine's; sessions record token-exact
trajectories; bad input is an OpenAI-style 4xx error and the server goes on."""

from __future__ import annotations

import copy
import json
import threading

import httpx
import openai
import pytest
import torch

from relayrl.env.agent_chat import ChatRendering, normalise_messages
from relayrl.env.openai_server import OpenAIServer
from relayrl.env.render import PlainRenderer
from relayrl.env.sessions import CallRecord, Session
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams
from relayrl.workers.actor import ReferenceWorker
from relayrl.workers.experience import Experience

CONTEXT = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=CONTEXT)
    return load_causal_lm(path), load_tokenizer(path)


def _engine(model, tok) -> RolloutEngine:
    return RolloutEngine(
        copy.deepcopy(model),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=4,
    )


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    srv = OpenAIServer(_engine(model, tok), tok)
    srv.start()
    yield srv
    srv.stop()


def _client(srv: OpenAIServer, session: Session | None = None) -> openai.OpenAI:
    key = session.key if session is not None else "EMPTY"
    return openai.OpenAI(base_url=srv.base_url(session), api_key=key, max_retries=0, timeout=60)


def _direct(model, tok, prompt: list[int], **params) -> tuple[list[int], list[float]]:
    """The same request on a fresh engine of the same weights (same seed)."""
    s = _engine(model, tok).generate([GenerationRequest(prompt, SamplingParams(**params))])[0]
    return s.response_ids, s.behaviour_logprobs


def test_chat_completion_returns_the_engines_tokens_and_logprobs(server, tiny):
    model, tok = tiny
    session = server.open_session()
    r = _client(server, session).chat.completions.create(
        model="policy",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        temperature=0.8,
        top_p=0.9,
        max_tokens=9,
        seed=11,
        logprobs=True,
    )
    # the plain format, by hand: "S:be brief\nU:hi\nA:", one id per character
    expected_prompt = tok("S:be brief\nU:hi\nA:", add_special_tokens=False)["input_ids"]
    assert r.model_extra["prompt_token_ids"] == expected_prompt
    ids, lps = _direct(
        model, tok, expected_prompt, temperature=0.8, top_p=0.9, max_tokens=9, seed=11
    )
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ids
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(lps, abs=1e-6)
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(expected_prompt)
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(expected_prompt) + len(ids)
    assert choice.finish_reason == ("stop" if ids[-1] == tok.eos_token_id else "length")
    assert choice.model_extra["versions"] == [0] * len(ids)
    (call,) = session.calls
    assert (call.prompt_ids, call.completion_ids) == (expected_prompt, ids)
    assert call.logprobs == pytest.approx(lps, abs=1e-6)


def test_n_choices_are_the_engines_and_each_is_recorded(server, tiny):
    """n = 3: three choices of one prompt, choice i seeded seed + i, generated together; each
    is a recorded call, and the second and third branch (a trajectory each)."""
    model, tok = tiny
    session = server.open_session()
    r = _client(server, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=7, seed=5, n=3
    )
    prompt = tok("U:hi\nA:", add_special_tokens=False)["input_ids"]
    reqs = [GenerationRequest(prompt, SamplingParams(max_tokens=7, seed=5 + i)) for i in range(3)]
    direct = _engine(model, tok).generate(reqs)  # the same three, batched as the server did
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in r.choices] == [s.response_ids for s in direct]
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1  # distinct seeds
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(len(s.response_ids) for s in direct)
    assert [c.prompt_ids for c in session.calls] == [prompt] * 3
    for call, s in zip(session.calls, direct, strict=True):
        assert call.completion_ids == s.response_ids
        assert call.logprobs == pytest.approx(s.behaviour_logprobs, abs=5e-5)
    assert [c.trajectory for c in session.calls] == [0, 1, 2] and session.prefix_breaks == 2
    assert len(session.to_samples()) == 3  # one sample per branch
    # completions: n = 2 over token ids, without a session
    c = _client(server).completions.create(model="policy", prompt=prompt, max_tokens=4, n=2)
    assert len(c.choices) == 2 and [x.index for x in c.choices] == [0, 1]


def test_completions_take_token_ids_or_text(server, tiny):
    model, tok = tiny
    client = _client(server)
    prompt = tok("12+34=", add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(
        model="policy", prompt=prompt, max_tokens=6, seed=3, logprobs=1, temperature=1.0
    )
    by_text = client.completions.create(
        model="policy", prompt="12+34=", max_tokens=6, seed=3, logprobs=1, temperature=1.0
    )
    ids, lps = _direct(model, tok, prompt, max_tokens=6, seed=3)
    for r in (by_ids, by_text):
        assert r.model_extra["prompt_token_ids"] == prompt
        assert r.choices[0].model_extra["token_ids"] == ids
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(lps, abs=1e-6)
        assert r.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    forced = client.completions.create(
        model="policy", prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert forced.usage.completion_tokens == 7 and forced.choices[0].finish_reason == "length"
    models = client.models.list()
    assert [m.id for m in models.data] == ["relayrl"]


def test_a_session_extends_one_trajectory_and_branches_into_new_ones(server, tiny):
    """Calls through /v1/completions with token ids: call 2 sends call 1's prompt +
    completion + 3 observation ids (extends), call 3 re-sends call 1's prompt (a branch),
    call 4 extends call 2's context (the longest matching trajectory)."""
    _, tok = tiny
    session = server.open_session(sampling={"seed": 5})
    client = _client(server, session)
    obs = tok("\nT:", add_special_tokens=False)["input_ids"]

    def complete(prompt: list[int]) -> list[int]:
        r = client.completions.create(model="policy", prompt=prompt, max_tokens=5)
        return r.choices[0].model_extra["token_ids"]

    p1 = tok("U:go\nA:", add_special_tokens=False)["input_ids"]
    c1 = complete(p1)
    p2 = p1 + c1 + obs
    c2 = complete(p2)
    c3 = complete(p1)
    p4 = p2 + c2 + obs
    c4 = complete(p4)
    assert [c.extended for c in session.calls] == [False, True, False, True]
    assert [c.trajectory for c in session.calls] == [0, 0, 1, 0]
    assert session.prefix_breaks == 1
    first, branch = session.to_samples()
    assert first.prompt_ids == p1
    assert first.response_ids == c1 + obs + c2 + obs + c4
    mask = [1] * len(c1) + [0] * len(obs) + [1] * len(c2) + [0] * len(obs) + [1] * len(c4)
    assert first.loss_mask == mask
    calls = session.calls
    lps = calls[0].logprobs + [0.0] * len(obs) + calls[1].logprobs + [0.0] * len(obs)
    assert first.behaviour_logprobs == lps + calls[3].logprobs
    assert (branch.prompt_ids, branch.response_ids, branch.loss_mask) == (p1, c3, [1] * len(c3))
    seeds = [c.sampling["seed"] for c in calls]  # the session seed's derivation, call by call
    assert seeds == [(5 * 1_000_003 + k) & 0x7FFFFFFF for k in range(4)]


def test_a_trajectorys_trainer_recompute_equals_the_behaviour_logprobs(server, tiny):
    """fp32, 1e-5 on every model token; observation tokens are not trained (mask 0)."""
    model, tok = tiny
    session = server.open_session(sampling={"seed": 9, "temperature": 0.7})
    client = _client(server, session)
    p1 = tok("U:ab\nA:", add_special_tokens=False)["input_ids"]
    c1 = client.completions.create(model="p", prompt=p1, max_tokens=6, temperature=1.3)
    ids1 = c1.choices[0].model_extra["token_ids"]
    obs = tok("\nU:cd\nA:", add_special_tokens=False)["input_ids"]
    client.completions.create(model="p", prompt=p1 + ids1 + obs, max_tokens=6)
    assert [c.sampling["temperature"] for c in session.calls] == [0.7, 0.7]  # the session's wins
    (sample,) = session.to_samples()
    exp = Experience.from_samples([sample], tok.pad_token_id)
    recomputed = ReferenceWorker(copy.deepcopy(model), 4, temperature=0.7).compute_logprobs(exp)
    mask = exp.response_mask[0].bool()
    assert (
        int(mask.sum())
        == sum(sample.loss_mask)
        == sum(len(c.completion_ids) for c in session.calls)
    )
    behav = torch.tensor(sample.behaviour_logprobs)
    n = len(sample.response_ids)
    assert torch.allclose(recomputed[0, :n][mask[:n]], behav[mask[:n]], atol=1e-5, rtol=0)


def test_bad_input_is_an_openai_error_with_a_4xx_code(server, tiny):
    _, tok = tiny
    session = server.open_session()
    client = _client(server, session)
    with pytest.raises(openai.NotFoundError) as e:
        _client(server, Session("sess-unknown")).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["code"] == "session_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x" * CONTEXT}]
        )
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"context is {CONTEXT} tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="p", messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0].role" in e.value.body["message"]
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "x"}], n=n
            )
        assert e.value.body["param"] == "n" and "n must be in [1, 16]" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="p", prompt=[], max_tokens=3)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="p", prompt=[10**6], max_tokens=3)
    assert "outside the vocabulary" in e.value.body["message"]
    url = server.base_url(session)
    for body in (
        b"{not json",
        b"[1, 2]",
        json.dumps({"messages": "hi"}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(),
    ):
        r = httpx.post(f"{url}/chat/completions", content=body, timeout=30)
        assert r.status_code == 400, body
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/v1/nothing", timeout=30).status_code == 404
    assert session.errors == 10 and session.calls == []
    ok = client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert ok.usage.completion_tokens >= 1  # the server goes on


def test_the_plain_rendering_equals_the_incremental_one_and_round_trips_tool_calls(tiny):
    """A whole conversation rendered at once (what the endpoint does every call) gives the
    ids the incremental PlainRenderer gives turn by turn; a reply's <tool_call> becomes an
    OpenAI tool call and, sent back as received, re-renders to the generated ids."""
    _, tok = tiny
    chat, plain = ChatRendering(tok), PlainRenderer(tok)
    text = 'ok<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    generated = chat.encode(text) + [tok.eos_token_id]
    reply = chat.message(generated, parse_tools=True)
    assert reply["content"] == text  # plain: the raw text, so it re-renders exactly
    (call,) = reply["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "1+2"}'}
    user = {"role": "user", "content": "1+2?"}
    tool = {"role": "tool", "content": "3", "tool_call_id": call["id"]}
    conversation = [user, reply, tool]
    incremental = plain.prompt([user]) + generated + plain.observation([tool])
    assert chat.prompt_ids(conversation) == incremental
    # an agent that keeps only the tool_calls (content None) gets the canonical JSON form
    bare = {"role": "assistant", "content": None, "tool_calls": reply["tool_calls"]}
    canonical = chat.encode(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    )
    assert chat.prompt_ids(normalise_messages([user, bare])) == plain.prompt([user]) + canonical + [
        tok.eos_token_id
    ] + chat.encode("A:")


def test_tools_reach_a_chat_template(tiny):
    _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = (
        "{% if tools %}{{ 'tools:' ~ (tools | map(attribute='function')"
        " | map(attribute='name') | join(',')) ~ '\n' }}{% endif %}"
        "{% for m in messages %}{{ m['role'][0] ~ ':' ~ m['content'] ~ '\n' }}{% endfor %}a:"
    )
    chat = ChatRendering(tok)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    ids = chat.prompt_ids([{"role": "user", "content": "hi"}], tools)
    assert ids == chat.encode("tools:calculator\nu:hi\na:")
    # template mode: the content is the text outside the tool-call blocks
    gen = chat.encode('so <tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    msg = chat.message(gen, parse_tools=True)
    assert msg["content"] == "so" and msg["tool_calls"][0]["function"]["name"] == "calculator"


def test_session_placement_by_hand():
    """Hand-built calls: the longest matching context wins; a non-matching one branches."""
    s = Session("k")
    s.record(CallRecord("completion", [1, 2], [3], [-0.5], [0], "stop"))
    s.record(CallRecord("completion", [1, 2, 3, 4], [5, 6], [-0.1, -0.2], [1, 1], "stop"))
    s.record(CallRecord("completion", [1, 2], [7], [-0.3], [1], "stop"))  # branch
    s.record(CallRecord("completion", [1, 2, 7, 8], [9], [-0.4], [2], "stop"))  # extends branch
    s.record(CallRecord("completion", [1, 9], [2], [-0.6], [2], "stop"))  # drift: new
    assert [c.trajectory for c in s.calls] == [0, 0, 1, 1, 2]
    assert s.prefix_breaks == 2
    a, b, c = s.to_samples(group_id=4)
    assert (a.prompt_ids, a.response_ids, a.loss_mask) == ([1, 2], [3, 4, 5, 6], [1, 0, 1, 1])
    assert a.behaviour_logprobs == [-0.5, 0.0, -0.1, -0.2]
    assert a.versions == [0, 0, 1, 1]  # the observation token carries the version before it
    assert (b.response_ids, b.loss_mask, b.versions) == ([7, 8, 9], [1, 0, 1], [1, 1, 2])
    assert (c.prompt_ids, c.response_ids) == ([1, 9], [2])
    assert {x.group_id for x in (a, b, c)} == {4}
    assert s.stats()["model_tokens"] == 6 and s.stats()["observation_tokens"] == 2


def test_a_weight_update_during_a_call_keeps_the_engines_versions(tiny):
    """An interrupting update while a chat call decodes: the reply's tokens carry version 0
    up to the update and 1 after it, as the engine stamped them, and the session records the
    same. The update is made by the engine's own step once 5 tokens exist (a poll from the
    test's thread could land after the reply ended on a busy machine)."""
    model, tok = tiny
    engine = _engine(model, tok)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}
    engine_step = engine.step

    def step():  # on the engine's thread: the update lands once 5 tokens exist, never later
        out = engine_step()
        if engine.version == 0 and engine.stats()["tokens_generated"] >= 5:
            engine.update_weights(new, 1, interrupt=True)
        return out

    engine.step = step  # type: ignore[method-assign]
    srv = OpenAIServer(engine, tok)
    srv.start()
    try:
        session = srv.open_session()
        client = _client(srv, session)
        result: dict = {}

        def call() -> None:
            result["r"] = client.chat.completions.create(
                model="p",
                messages=[{"role": "user", "content": "go"}],
                max_tokens=40,
                seed=2,
                extra_body={"ignore_eos": True},
            )

        thread = threading.Thread(target=call)
        thread.start()
        thread.join(60)
    finally:
        srv.stop()
    versions = result["r"].choices[0].model_extra["versions"]
    assert len(versions) == 40 and versions == sorted(versions)
    assert versions[0] == 0 and versions[-1] == 1, versions
    assert session.calls[0].versions == versions


def test_the_session_key_may_come_as_the_api_key_or_a_header(server):
    by_key, by_header = server.open_session(), server.open_session()
    plain = server.base_url()
    openai.OpenAI(base_url=plain, api_key=by_key.key, max_retries=0).completions.create(
        model="p", prompt=[5, 6], max_tokens=2
    )
    openai.OpenAI(
        base_url=plain,
        api_key="EMPTY",
        max_retries=0,
        default_headers={"X-Session-Id": by_header.key},
    ).completions.create(model="p", prompt=[7, 8], max_tokens=2)
    assert [c.prompt_ids for c in by_key.calls] == [[5, 6]]
    assert [c.prompt_ids for c in by_header.calls] == [[7, 8]]
    server.close_session(by_key.key)
    with pytest.raises(openai.NotFoundError):  # a closed session is refused
        _client(server, by_key).completions.create(model="p", prompt=[5], max_tokens=1)


def test_a_server_with_an_api_key_refuses_other_keys(tiny):
    model, tok = tiny
    with OpenAIServer(_engine(model, tok), tok, api_key="secret") as srv:
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=srv.base_url(), api_key="wrong", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=srv.base_url(), api_key="secret", max_retries=0)
        assert ok.completions.create(model="p", prompt=[5], max_tokens=1).usage.total_tokens == 2

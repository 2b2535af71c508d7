"""Where a vLLM-server user of the ``openai`` client meets the endpoint's limits: a
``max_tokens`` past the context is a 400 naming it (capped only where ``cap_max_tokens``, the
training endpoint's setting), ``stream_options`` without ``stream`` is a 400, ``/v1/completions``
takes a batch of prompts, and vLLM's ``/tokenize`` / ``/detokenize`` answer."""

from __future__ import annotations

import openai
import pytest

from relayrl.env.agent_rollout import AgentRollout
from relayrl.env.openai_server import OpenAIServer
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

CONTEXT = 40
M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("parity"), max_position_embeddings=CONTEXT)
    return load_causal_lm(path), load_tokenizer(path)


def _server(tiny, **kw) -> OpenAIServer:
    model, tok = tiny
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=8
    )
    srv = OpenAIServer(engine, tok, "tiny", strict_model=True, **kw)
    srv.start()
    return srv


@pytest.fixture(scope="module")
def server(tiny):
    srv = _server(tiny)
    yield srv
    srv.stop()


def _client(srv: OpenAIServer, base: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base or srv.base_url(), api_key="EMPTY", max_retries=0, timeout=60
    )


def _drain(stream) -> None:  # type: ignore[no-untyped-def]
    for _ in stream:
        pass


# ------------------------------------------------------------------ max_tokens past the context
def test_max_tokens_past_the_context_is_a_400_naming_it(server):
    """The plain-format prompt "U:hi\\nA:" is 7 tokens (one per character): room for
    40 - 7 = 33; 33 is served in full, 34 is a 400 naming the field and the numbers."""
    c = _client(server)
    ok = c.chat.completions.create(
        model="tiny", messages=M, max_tokens=33, extra_body={"ignore_eos": True}
    )
    assert (ok.usage.prompt_tokens, ok.usage.completion_tokens) == (7, 33)
    for stream in (False, True):
        for name in ("max_tokens", "max_completion_tokens"):
            with pytest.raises(openai.BadRequestError) as e:
                _drain(
                    c.chat.completions.create(model="tiny", messages=M, stream=stream, **{name: 34})
                )  # type: ignore[arg-type]
            body = e.value.body
            assert (body["param"], body["code"]) == (name, "invalid_value")
            assert f"{name} is too large: 34 > 40 - 7" in body["message"]
        with pytest.raises(openai.BadRequestError) as e:  # completions: "abc" is 3 tokens
            _drain(c.completions.create(model="tiny", prompt="abc", max_tokens=38, stream=stream))
        assert e.value.body["param"] == "max_tokens"
        assert "38 > 40 - 3" in e.value.body["message"]
    r = c.completions.create(
        model="tiny", prompt="abc", max_tokens=37, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 37


def test_the_responses_api_names_max_output_tokens(server):
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).responses.create(model="tiny", input="hi", max_output_tokens=34)
    assert e.value.body["param"] == "max_output_tokens"


def test_the_training_endpoint_caps_max_tokens_at_the_rest_of_the_context(tiny):
    """``cap_max_tokens`` (AgentRollout's server): the same request ends in 'length' at 33."""
    srv = _server(tiny, cap_max_tokens=True)
    try:
        r = _client(srv).chat.completions.create(
            model="tiny", messages=M, max_tokens=500, extra_body={"ignore_eos": True}
        )
    finally:
        srv.stop()
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (33, "length")


def _long_agent(base_url: str, api_key: str, row: dict) -> float:
    """One chat call asking far past the context: reward 1 when it ended in 'length'."""
    c = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model="p", messages=M, max_tokens=1000, extra_body={"ignore_eos": True}
    )
    return float(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 33)


def test_an_agent_rollout_gets_the_cap_not_the_400(tiny):
    """Training: the agent's too-large max_tokens is cut to the rest of the context (33), its
    rollout succeeds (with the 400, the agent raises and the rollout is a failure)."""
    model, tok = tiny
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=2
    )
    rollout = AgentRollout(engine, tok, _long_agent)
    try:
        req = GenerationRequest([1], SamplingParams(max_tokens=1000, seed=0), metadata={})
        (sample,) = rollout.generate([req])
    finally:
        rollout.close()
    assert sample.metadata["env"]["outcome"] == 1.0, sample.metadata["env"]


# ------------------------------------------------------------------ stream_options
def test_stream_options_without_stream_is_a_400(server):
    c = _client(server)
    opts = {"include_usage": True}
    for create, kw in (
        (c.chat.completions.create, {"messages": M}),
        (c.completions.create, {"prompt": "ab"}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create(model="tiny", max_tokens=2, stream_options=opts, **kw)  # type: ignore[operator]
        assert e.value.body["param"] == "stream_options"
        chunks = list(create(model="tiny", max_tokens=2, stream=True, stream_options=opts, **kw))  # type: ignore[operator]
        assert chunks[-1].usage is not None


# ------------------------------------------------------------------ batched prompts
@pytest.mark.parametrize("prompts", [["12+", "7*8="], [[5, 6, 7], [9, 10]]])
def test_a_batch_of_prompts_answers_choice_i_n_plus_j(server, prompts):
    """Choice ``i * n + j`` is prompt i's choice j, the tokens a request of prompt i alone
    gets (same seed), streamed or not; the usage counts each prompt once."""
    c = _client(server)
    ask = dict(model="tiny", max_tokens=5, n=2, seed=3, extra_body={"ignore_eos": True})
    alone = [c.completions.create(prompt=p, **ask) for p in prompts]  # type: ignore[arg-type]
    r = c.completions.create(prompt=prompts, **ask)  # type: ignore[arg-type]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.model_extra["token_ids"] for ch in r.choices] == [
        ch.model_extra["token_ids"] for a in alone for ch in a.choices
    ]
    assert [ch.text for ch in r.choices] == [ch.text for a in alone for ch in a.choices]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 4 * 5
    assert r.model_extra["prompt_token_ids"] == [a.model_extra["prompt_token_ids"] for a in alone]
    ids: dict[int, list[int]] = {i: [] for i in range(4)}
    text: dict[int, str] = {i: "" for i in range(4)}
    for chunk in c.completions.create(prompt=prompts, stream=True, **ask):  # type: ignore[arg-type]
        for ch in chunk.choices:
            ids[ch.index] += ch.model_extra.get("token_ids") or []
            text[ch.index] += ch.text
    assert [ids[i] for i in range(4)] == [ch.model_extra["token_ids"] for ch in r.choices]
    assert [text[i] for i in range(4)] == [ch.text for ch in r.choices]


@pytest.mark.parametrize("prompt", [[], ["ab", [5]], ["ab", ""], [[5], []], [[5], ["x"]]])
def test_a_malformed_batch_is_a_400(server, prompt):
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert e.value.body["param"] == "prompt"


def test_a_batch_with_one_prompt_past_the_context_is_refused_whole(server):
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model="tiny", prompt=["ab", "x" * CONTEXT])
    assert e.value.body["code"] == "context_length_exceeded"


# ------------------------------------------------------------------ /tokenize, /detokenize
def test_tokenize_gives_the_ids_the_routes_generate_from(server):
    c = _client(server, server.url)
    chat = _client(server).chat.completions.create(model="tiny", messages=M, max_tokens=1)
    out = c.post("/tokenize", body={"model": "tiny", "messages": M}, cast_to=object)
    assert out == {  # type: ignore[comparison-overlap]
        "count": 7,
        "max_model_len": CONTEXT,
        "tokens": chat.model_extra["prompt_token_ids"],
        "token_strs": None,
    }
    done = _client(server).completions.create(model="tiny", prompt="12+34=", max_tokens=1)
    out = c.post(
        "/tokenize",
        body={"model": "tiny", "prompt": "12+34=", "return_token_strs": True},
        cast_to=object,
    )
    assert out["tokens"] == done.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert out["token_strs"] == list("12+34=")  # type: ignore[index]
    back = c.post("/detokenize", body={"model": "tiny", "tokens": out["tokens"]}, cast_to=object)  # type: ignore[index]
    assert back == {"prompt": "12+34="}  # type: ignore[comparison-overlap]
    for path, body in (
        ("/detokenize", {"model": "tiny", "tokens": [10**6]}),
        ("/detokenize", {"model": "tiny", "tokens": "ab"}),
        ("/tokenize", {"model": "tiny"}),
        ("/tokenize", {"model": "tiny", "messages": M, "add_generation_prompt": False}),
    ):
        with pytest.raises(openai.BadRequestError):
            c.post(path, body=body, cast_to=object)
    with pytest.raises(openai.NotFoundError):
        c.post("/tokenize", body={"model": "other", "prompt": "a"}, cast_to=object)


# ------------------------------------------------------------------ top_logprobs
def _entries(content) -> list[tuple[str, float, list[tuple[str, float]]]]:  # type: ignore[no-untyped-def]
    return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in content]


def test_chat_top_logprobs_streamed_and_not(server):
    """top_logprobs=3: each token lists 3 alternatives, most likely first; greedy, the first is
    the token itself at its logprob; asking changes no token and no logprob (seeded), and the
    streamed entries are the unstreamed ones."""
    c = _client(server)
    ask = dict(model="tiny", messages=M, max_tokens=6, extra_body={"ignore_eos": True})
    greedy = c.chat.completions.create(temperature=0, logprobs=True, top_logprobs=3, **ask)
    for tok, lp, alts in _entries(greedy.choices[0].logprobs.content):
        assert len(alts) == 3 and alts[0] == (tok, lp)
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
    plain = c.chat.completions.create(seed=4, logprobs=True, **ask).choices[0]
    top = c.chat.completions.create(seed=4, logprobs=True, top_logprobs=3, **ask).choices[0]
    assert top.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert [e.logprob for e in top.logprobs.content] == [e.logprob for e in plain.logprobs.content]
    assert all(e.top_logprobs == [] for e in plain.logprobs.content)
    streamed = []
    for chunk in c.chat.completions.create(
        seed=4, logprobs=True, top_logprobs=3, stream=True, **ask
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += _entries(chunk.choices[0].logprobs.content)
    assert streamed == _entries(top.logprobs.content)


def test_completions_logprobs_k_lists_k_alternatives_streamed_and_not(server):
    c = _client(server)
    ask = dict(model="tiny", prompt="ab", max_tokens=6, seed=2, extra_body={"ignore_eos": True})
    r = c.completions.create(logprobs=2, **ask).choices[0].logprobs
    assert len(r.top_logprobs) == 6 and all(1 <= len(t) <= 2 for t in r.top_logprobs)
    plain = c.completions.create(logprobs=0, **ask).choices[0].logprobs
    assert plain.top_logprobs is None and plain.token_logprobs == r.token_logprobs
    tops: list[dict[str, float]] = []
    for chunk in c.completions.create(logprobs=2, stream=True, **ask):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tops += chunk.choices[0].logprobs.top_logprobs
    assert tops == r.top_logprobs


def test_bad_top_logprobs_requests_are_400s(server, tiny):
    c = _client(server)
    for kw in (
        {"top_logprobs": 2},  # without logprobs: true
        {"top_logprobs": 21, "logprobs": True},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=M, max_tokens=2, **kw)  # type: ignore[arg-type]
        assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="ab", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", max_output_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


class NoAlternatives(RolloutEngine):
    supports_top_logprobs = False


def test_an_engine_without_alternatives_refuses_chat_top_logprobs(tiny):
    model, tok = tiny
    engine = NoAlternatives(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=2
    )
    with OpenAIServer(engine, tok, "tiny") as srv:
        c = _client(srv)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="tiny", messages=M, max_tokens=2, logprobs=True, top_logprobs=2
            )
        assert (e.value.body["param"], e.value.body["code"]) == ("top_logprobs", "unsupported")
        r = c.completions.create(model="tiny", prompt="ab", max_tokens=2, logprobs=2)
        assert r.choices[0].logprobs.top_logprobs is None  # as before: no alternatives

"""What a vLLM-server user of the ``openai`` client expects of the endpoint, beyond the other
endpoint tests: vLLM's ``top_k`` honoured and its fields the engine cannot honour refused (never
silently ignored), a malformed parameter a 400 (never a 500), ``/health`` and
``models.retrieve``, and an unstreamed request whose client goes away aborted on the engine."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from relayrl.env.openai_server import OpenAIServer
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import RolloutEngine

M = [{"role": "user", "content": "hi"}]
CONTEXT = 320  # more than DEFAULT_MAX_TOKENS


class GatedEngine(RolloutEngine):
    """A RolloutEngine that, once ``gate`` is set, stops after the first step with a request
    running until the test releases it (the request is then live on the engine)."""

    gate: tuple[threading.Event, threading.Event] | None = None

    def step(self):  # type: ignore[no-untyped-def]
        out = super().step()
        gate = self.gate
        if gate is not None and self.stats()["num_running"]:
            self.gate = None
            gate[0].set()
            gate[1].wait(60)
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("compat")
    path = build_tiny_model(root / "m", max_position_embeddings=CONTEXT)
    tok = load_tokenizer(path)
    engine = GatedEngine(
        load_causal_lm(path),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=4,
    )
    srv = OpenAIServer(engine, tok, "tiny", strict_model=True)
    srv.start()
    yield srv
    srv.stop()


def _client(srv: OpenAIServer, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url(), api_key="EMPTY", max_retries=0, timeout=timeout)


def test_top_k_is_honoured(server):
    """top_k = 1 keeps the argmax only: at temperature 1 the reply is the greedy one."""
    c = _client(server)
    ask = dict(model="tiny", messages=M, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = c.chat.completions.create(temperature=0, **ask).choices[0].model_extra["token_ids"]
    for seed in (1, 2):
        sampled = c.chat.completions.create(seed=seed, **ask).choices[0]
        assert sampled.model_extra["token_ids"] != greedy  # without top_k: not the argmax
        top1 = c.chat.completions.create(
            model="tiny",
            messages=M,
            max_tokens=12,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 1},
        )
        assert top1.choices[0].model_extra["token_ids"] == greedy
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=M, extra_body={"top_k": -2})
    assert e.value.body["param"] == "top_k"


@pytest.mark.parametrize(
    "extra",
    [
        {"min_p": 0.1},
        {"min_tokens": 2},
        {"include_stop_str_in_output": True},
        {"use_beam_search": True},
    ],
)
def test_vllm_fields_the_engine_cannot_honour_are_refused(server, extra):
    (name,) = extra
    c = _client(server)
    for create, kw in (
        (c.chat.completions.create, {"messages": M}),
        (c.completions.create, {"prompt": "ab"}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create(model="tiny", max_tokens=2, extra_body=extra, **kw)  # type: ignore[operator]
        assert e.value.body["param"] == name and e.value.body["code"] == "unsupported"


def test_a_malformed_parameter_is_a_400_never_a_500(server):
    url = f"{server.url}/v1"
    for route, body in (
        ("chat/completions", {"model": "tiny", "messages": M, "best_of": "x"}),
        ("completions", {"model": "tiny", "prompt": "ab", "best_of": [2]}),
        ("chat/completions", {"model": "tiny", "messages": M, "max_completion_tokens": 0}),
        ("chat/completions", {"model": "tiny", "messages": M, "logprobs": "yes"}),
        ("completions", {"model": "tiny", "prompt": "ab", "logprobs": -1}),
        ("completions", {"model": "tiny", "prompt": "ab", "logprobs": "x"}),
        ("chat/completions", {"model": "tiny", "messages": M, "stream": "no"}),
    ):
        r = httpx.post(f"{url}/{route}", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_health_and_model_retrieval(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    c = _client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    (card,) = c.models.list().data
    assert (card.id, card.model_extra["max_model_len"]) == ("tiny", CONTEXT)  # as vLLM lists it
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"


def test_an_unstreamed_request_whose_client_goes_away_is_aborted(server):
    """The engine holds with the request running; the client times out and goes away; the
    server asks the engine to abort it: it ends as an 'abort' sample, not at max_tokens."""
    held, release = threading.Event(), threading.Event()
    finished: list[str] = []
    server.owner.observe(lambda s: finished.append(s.finish_reason))
    aborts = server.owner.aborts_requested
    server.owner.engine.gate = (held, release)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            _client(server, timeout=1.0).completions.create(
                model="tiny", prompt="ab", max_tokens=80, extra_body={"ignore_eos": True}
            )
        except openai.APITimeoutError as exc:
            errors.append(exc)

    t = threading.Thread(target=ask)
    t.start()
    try:
        assert held.wait(60)
        t.join(60)
        assert len(errors) == 1  # the client gave up while the engine held its request
        for _ in range(300):  # the server noticed the disconnect and asked for the abort
            if server.owner.aborts_requested > aborts:
                break
            time.sleep(0.1)
        assert server.owner.aborts_requested == aborts + 1
    finally:
        release.set()
    for _ in range(300):
        if finished:
            break
        time.sleep(0.1)
    assert finished == ["abort"]
    assert server.owner.call(lambda e: e.stats()["num_running"]) == 0


def test_completions_logprobs_0_streams_the_logprobs_it_answers_unstreamed(server):
    """Completions' logprobs = 0 asks for the sampled tokens' logprobs (no alternatives),
    streamed or not."""
    c = _client(server)
    ask = dict(model="tiny", prompt="ab", max_tokens=6, temperature=0, logprobs=0)
    plain = c.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert plain is not None and len(plain.token_logprobs) == 6
    lps: list[float] = []
    for chunk in c.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            lps += chunk.choices[0].logprobs.token_logprobs
    assert lps == plain.token_logprobs


def test_a_prompt_with_no_room_names_the_parameter_it_came_in(server):
    c = _client(server)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="x" * CONTEXT, max_tokens=2, stream=stream)
        body = e.value.body
        assert (body["code"], body["param"]) == ("context_length_exceeded", "prompt")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x" * CONTEXT}], stream=stream
            )
        assert e.value.body["param"] == "messages"


def test_a_request_without_max_tokens_gets_the_servers_default_or_the_rest_of_the_context(
    server,
):
    """DEFAULT_MAX_TOKENS (256) by default; with default_max_tokens=None (``relayrl serve``'s
    default, as vLLM): the rest of the context, 320 - 2 prompt tokens."""
    ask = dict(model="tiny", prompt="ab", extra_body={"ignore_eos": True})
    r = _client(server).completions.create(**ask)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (256, "length")
    server.default_max_tokens = None
    try:
        r = _client(server).completions.create(**ask)
    finally:
        server.default_max_tokens = 256
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, CONTEXT - 2)
    assert r.choices[0].finish_reason == "length"

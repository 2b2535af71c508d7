"""How many sequences one request to the OpenAI-compatible endpoint may ask for, through the
official ``openai`` client against a real server on a tiny random model: prompts x ``n`` past
``max_sequences_per_request`` is a 400 (``too_many_sequences``) naming the count and the limit,
answered before anything is tokenised or queued on the engine, streamed or not; ``n`` below 1
is a 400; at the limit, and with no limit, the request is served."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from relayrl.config.agent import AgentConfig
from relayrl.env.agent_rollout import attach_agent
from relayrl.env.openai_server import DEFAULT_MAX_SEQUENCES, OpenAIServer
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import RolloutEngine

LIMIT = 12
PROMPTS = ["a", "b", "c", "d", "e"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=64)
    return load_causal_lm(path), load_tokenizer(path)


def _server(tiny: tuple[Any, Any], limit: int | None) -> OpenAIServer:
    return OpenAIServer(_engine(tiny), tiny[1], max_sequences_per_request=limit)


def _engine(tiny: tuple[Any, Any]) -> RolloutEngine:
    model, tok = tiny
    return RolloutEngine(
        copy.deepcopy(model), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )


@pytest.fixture(scope="module")
def server(tiny: tuple[Any, Any]) -> Iterator[OpenAIServer]:
    srv = _server(tiny, LIMIT)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def work(server: OpenAIServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the server did for a request: "tokenise" (a prompt rendered or encoded off the
    loop) and "queue" (a sequence handed to the engine)."""
    done: list[str] = []
    run, generate = server.off_loop.run, server.owner.generate

    async def counted_run(fn: Any, *args: Any) -> Any:
        done.append("tokenise")
        return await run(fn, *args)

    def counted_generate(*args: Any, **kwargs: Any) -> Any:
        done.append("queue")
        return generate(*args, **kwargs)

    monkeypatch.setattr(server.off_loop, "run", counted_run)
    monkeypatch.setattr(server.owner, "generate", counted_generate)
    return done


def _client(srv: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url(), api_key="EMPTY", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_times_n_past_the_limit_is_a_400_before_any_work(
    server: OpenAIServer, work: list[str], stream: bool
) -> None:
    """5 prompts x n=3 = 15 > 12: refused, naming both keys' counts and the limit."""
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(
            model="p", prompt=PROMPTS, n=3, max_tokens=1, stream=stream
        )
    err = e.value.body
    assert e.value.status_code == 400
    assert (err["code"], err["param"], err["type"]) == (
        "too_many_sequences",
        "prompt",
        "invalid_request_error",
    )
    assert "15 sequences (5 prompts x n=3)" in err["message"]
    assert "at most 12 per request (max_sequences_per_request)" in err["message"]
    assert "\n" not in err["message"]
    assert work == []  # nothing tokenised, nothing queued


def test_token_id_prompts_are_counted_as_prompts(server: OpenAIServer, work: list[str]) -> None:
    """A list of ids is one prompt; a list of id lists is a batch: 13 prompts x n=1 > 12."""
    client = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="p", prompt=[[5, 6]] * 13, max_tokens=1)
    assert e.value.body["code"] == "too_many_sequences"
    assert "13 sequences (13 prompts x n=1)" in e.value.body["message"]
    assert work == []
    ids = list(range(5, 5 + 20))  # 20 ids: one prompt, n=1
    assert len(client.completions.create(model="p", prompt=ids, max_tokens=1).choices) == 1


def test_chat_n_past_the_limit_is_a_400(tiny: tuple[Any, Any]) -> None:
    """Chat has one prompt: n alone is counted (limit 3, n=4)."""
    with _server(tiny, 3) as srv:
        client = _client(srv)
        messages = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model="p", messages=messages, n=4, max_tokens=1, stream=stream
                )
            assert (e.value.body["code"], e.value.body["param"]) == ("too_many_sequences", "n")
            assert "4 sequences (n=4)" in e.value.body["message"]
        r = client.chat.completions.create(model="p", messages=messages, n=3, max_tokens=1)
        assert len(r.choices) == 3


def test_at_the_limit_the_batch_is_served(server: OpenAIServer) -> None:
    """4 prompts x n=3 = 12 = the limit: 12 choices, prompt i's choice j at i * 3 + j."""
    r = _client(server).completions.create(model="p", prompt=PROMPTS[:4], n=3, max_tokens=1)
    assert [c.index for c in r.choices] == list(range(12))
    ids = r.model_extra["prompt_token_ids"]
    assert len(ids) == 4


def test_n_below_one_is_a_400(server: OpenAIServer, work: list[str]) -> None:
    client = _client(server)
    for n in (0, -1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="p", prompt=PROMPTS, n=n, max_tokens=1)
        assert e.value.body["param"] == "n"
        assert f"n must be in [1, 16], got {n}" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "x"}], n=n
            )
        assert e.value.body["param"] == "n"
    assert work == []


def test_no_limit_serves_any_batch(tiny: tuple[Any, Any]) -> None:
    """None: unbounded (as vLLM): 5 prompts x n=3 = 15 choices."""
    with _server(tiny, None) as srv:
        r = _client(srv).completions.create(model="p", prompt=PROMPTS, n=3, max_tokens=1)
    assert len(r.choices) == 15


def test_the_limit_is_checked_where_it_is_set(tiny: tuple[Any, Any]) -> None:
    assert DEFAULT_MAX_SEQUENCES == 256
    assert AgentConfig().max_sequences_per_request == 256
    assert AgentConfig(max_sequences_per_request=None).max_sequences_per_request is None
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        AgentConfig(max_sequences_per_request=0)
    with pytest.raises(ValueError, match="max_sequences_per_request must be >= 1"):
        _server(tiny, 0)


def quiet_agent(base_url: str, api_key: str, row: Any) -> float:
    return 0.0


def test_env_agent_max_sequences_per_request_reaches_the_training_endpoint(
    tiny: tuple[Any, Any],
) -> None:
    """``env.agent.max_sequences_per_request: 2`` -> the agents' endpoint refuses n=3."""
    agent = AgentConfig(
        function="test_openai_request_limits:quiet_agent", max_sequences_per_request=2
    )
    roles = SimpleNamespace(
        rollout=_engine(tiny), tokenizer=tiny[1], reward=SimpleNamespace(service=None, fn=None)
    )
    rollout = attach_agent(roles, SimpleNamespace(env=SimpleNamespace(agent=agent))).rollout
    try:
        client = _client(rollout.server)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="p", prompt="a", n=3, max_tokens=1)
        assert "at most 2 per request" in e.value.body["message"]
        assert len(client.completions.create(model="p", prompt="a", n=2, max_tokens=1).choices) == 2
    finally:
        rollout.close()

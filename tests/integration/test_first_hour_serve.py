"""The first hour (issue 44), ``relayrl serve``: a busy port is one line; the endpoint answers
another model's name 404 and a huge body 413 (also streamed without a length), and one slow
tokenisation does not hold up other requests."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from relayrl.model import build_tiny_model
from tiny_runs import run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


# ---- relayrl serve: a busy port, another model's name, a huge body, a slow tokenisation ----
def test_serve_on_a_busy_port_is_one_line(tiny, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc, err = run_cli(capsys, ["serve", str(tiny), "--port", str(port), "--seconds", "0.1"])
    assert rc == 2
    assert err == (
        f"relayrl serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another port with --port (0: any free one)"
    )


@pytest.fixture
def strict_server(tiny):
    from relayrl.env.openai_server import OpenAIServer
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.rollout import RolloutEngine

    tok = load_tokenizer(tiny)
    engine = RolloutEngine(
        load_causal_lm(tiny), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    srv = OpenAIServer(engine, tok, "tiny", max_body_bytes=1 << 20, strict_model=True)
    srv.start()
    yield srv
    srv.stop()


def test_serve_answers_another_model_404_and_a_huge_body_413(strict_server):
    url = strict_server.base_url()
    small = {"prompt": "1+1=", "max_tokens": 2}
    with httpx.Client(timeout=60) as http:
        assert http.post(f"{url}/completions", json={**small, "model": "tiny"}).status_code == 200
        assert http.post(f"{url}/completions", json=small).status_code == 200  # no name: ok
        r = http.post(f"{url}/completions", json={**small, "model": "gpt-4o"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        r = http.post(f"{url}/completions", json={**small, "prompt": "x" * (2 << 20)})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit holds while the body streams in
            for _ in range(3):
                yield b" " * (1 << 19)

        r = http.post(f"{url}/completions", content=chunks())
        assert r.status_code == 413


def test_one_slow_tokenisation_does_not_block_other_requests(strict_server, monkeypatch):
    """A prompt whose tokenisation does not end (a 20 MB body took 33 s on the serving loop)
    holds no other request: a small one sent while it is being tokenised is answered, and
    only then is the slow one let go (events, no timing)."""
    from relayrl.env.agent_chat import ChatRendering

    real_encode = ChatRendering.encode
    entered, release = threading.Event(), threading.Event()

    def encode(self, text):
        if text.startswith("slow"):
            entered.set()
            assert release.wait(120), "the slow tokenisation was never let go"
        return real_encode(self, text)

    monkeypatch.setattr(ChatRendering, "encode", encode)
    url = strict_server.base_url()
    status: dict[str, int] = {}

    def post(name: str, prompt: str) -> None:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{url}/completions", json={"prompt": prompt, "max_tokens": 2})
        status[name] = r.status_code

    slow = threading.Thread(target=post, args=("slow", "slow 1+1="))
    slow.start()
    try:
        assert entered.wait(60), "the slow request never reached tokenisation"
        post("fast", "1+1=")  # answered while the slow one is still inside encode
        assert status == {"fast": 200} and not release.is_set()
    finally:
        release.set()
        slow.join(timeout=120)
    assert status == {"fast": 200, "slow": 200}

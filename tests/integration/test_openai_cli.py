"""``relayrl serve MODEL_DIR``: a real process serving the endpoint to the ``openai`` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from relayrl.cli import main
from relayrl.model import build_tiny_model


@pytest.mark.slow  # a fresh interpreter importing torch: ~10 s alone, ~45 s on a loaded machine
def test_serve_answers_the_openai_client_and_stops_on_sigint(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", max_position_embeddings=64)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        "serve",
        str(model),
        "--port",
        "0",
        "--seconds",
        "120",
        "--threads",
        "1",
        "--max-sequences",
        "4",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() else "")
        base_url = line.split(" at ")[-1].strip()
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.models.retrieve("tiny").model_extra["max_model_len"] == 64
        health = httpx.get(base_url.removesuffix("/v1") + "/health", timeout=30)
        assert health.status_code == 200  # what vLLM users poll before sending requests
        full = client.completions.create(model="tiny", prompt="ab", extra_body={"ignore_eos": True})
        assert full.usage.completion_tokens == 64 - 2  # no max_tokens: the rest of the context
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1
        )
        assert 1 <= r.usage.completion_tokens <= 4
        ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12)
        plain = client.chat.completions.create(temperature=0, **ask)
        chunks = list(client.chat.completions.create(temperature=0, stream=True, **ask))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content  # streamed token by token, same text
        with pytest.raises(openai.BadRequestError, match="max_sequences_per_request"):
            client.completions.create(model="tiny", prompt=["a", "b", "c"], n=2, max_tokens=1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "stopped" in out
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_serve_names_a_missing_model_dir(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_serve_refuses_a_negative_sequence_limit_in_one_line(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "tiny", max_position_embeddings=64)
    assert main(["serve", str(model), "--max-sequences", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-sequences must be >= 0" in err

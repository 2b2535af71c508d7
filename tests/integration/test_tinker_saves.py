"""relayrl's Tinker service through the real ``tinker`` SDK: a ``save_state`` name that exists
is refused unless ``overwrite=True`` (Tinker's server answers 409 "already exists ... choose a
different name"); a sampler path saved again serves the old weights to the sample requests
sent before the save and the new ones to those sent after it, whatever the worker's queue
holds; a checkpoint delete is a barrier too (a sample request sent after it is served as the
store stands after the delete, never by the deleted weights); a prompt exactly as long as the
context is scored by ``compute_logprobs``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tinker_hold import held_worker

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker import rest as tinker_rest  # noqa: E402
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


def test_a_sampler_path_saved_again_serves_requests_in_the_order_they_were_sent(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is held (in an optim_step) while three requests queue behind it: a
    compute_logprobs on the "latest" sampler, save_weights_for_sampler("latest") of the
    stepped weights, a second compute_logprobs. The first is served the old "latest", the
    second the new one (the worker used to take every queued sample request at once, ahead
    of the save: both got the old weights)."""
    client, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=5).result()
    path = tc.save_weights_for_sampler("latest").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    old = _logprobs(tc, TOKENS)
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()

    prompt = types.ModelInput.from_ints(TOKENS)
    with held_worker(server, monkeypatch) as held:
        step = tc.optim_step(types.AdamParams(learning_rate=0.1))
        held.next_queued()
        assert held.started.wait(60)  # the worker is in the step; what follows queues behind it
        before = sampler.compute_logprobs(prompt)
        held.next_queued()
        saved = tc.save_weights_for_sampler("latest")
        held.next_queued()
        after = sampler.compute_logprobs(prompt)
        held.next_queued()
        assert server.worker.queued() == 3
    step.result()
    assert saved.result().path == path
    new = _logprobs(tc, TOKENS)
    assert not np.allclose(old, new, atol=1e-3)
    np.testing.assert_allclose(before.result()[1:], old, atol=1e-4)
    np.testing.assert_allclose(after.result()[1:], new, atol=1e-4)


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


def test_a_checkpoint_keeps_its_own_user_metadata(served: Any) -> None:
    """``save_state`` / ``save_weights_for_sampler(..., user_metadata=)`` is kept with the
    checkpoint and comes back where Tinker returns it, ``Checkpoint.user_metadata``: in
    ``list_checkpoints``, ``list_user_checkpoints`` and the training run's last checkpoints,
    apart from the run's own ``user_metadata`` (it used to be dropped: None everywhere). An
    overwrite replaces it, and drops it when it sends none (the SDK's ``save_state`` docs)."""
    client, base, server = served
    tc = client.create_lora_training_client(
        base_model=str(base), rank=4, user_metadata={"run": "r1"}
    ).result()
    c = tc.save_state("c").result().path
    b = tc.save_weights_for_sampler("b", user_metadata={"kind": "eval"}).result().path
    a = tc.save_state("a", user_metadata={"step": "3", "note": "warm"}).result().path
    rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)

    def own() -> dict[str, Any]:
        listed = rest.list_checkpoints(tc.model_id).result().checkpoints
        return {x.tinker_path: x.user_metadata for x in listed}

    assert own() == {c: None, b: {"kind": "eval"}, a: {"step": "3", "note": "warm"}}
    every = rest.list_user_checkpoints().result().checkpoints
    assert {x.tinker_path: x.user_metadata for x in every if x.tinker_path in own()} == own()
    run = rest.get_training_run(tc.model_id).result()
    assert run.user_metadata == {"run": "r1"}
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == a
    assert run.last_checkpoint.user_metadata == {"step": "3", "note": "warm"}
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.user_metadata == {"kind": "eval"}
    tc.save_state("a", overwrite=True, user_metadata={"step": "4"}).result()
    assert own()[a] == {"step": "4"}
    tc.save_state("a", overwrite=True).result()
    assert own() == {c: None, b: {"kind": "eval"}, a: None}
    loaded = client.create_training_client_from_state(a).result()  # the run's, not the save's
    assert rest.get_training_run(loaded.model_id).result().user_metadata == {"run": "r1"}


def test_a_sample_request_sent_after_a_delete_waits_for_it(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is held (in an optim_step) while four requests queue behind it: a sample on
    the sampler checkpoint "doomed", a sample on the base model (it leaves the engine on the
    base weights), the delete of "doomed", a second sample on "doomed". The first two share a
    batch ahead of the step; the third must reload "doomed" once the delete ran and fails
    ("no checkpoint"). Were the delete not a barrier, the second "doomed" sample would join
    the first one's batch, ahead of the delete, and be served the deleted weights."""
    client, base, server = served
    tc = client.create_lora_training_client(base_model=str(base), rank=4, seed=3).result()
    path = tc.save_weights_for_sampler("doomed").result().path
    doomed = client.create_sampling_client(model_path=path).result()
    base_sampler = client.create_sampling_client(base_model=str(base)).result()
    prompt, params = types.ModelInput.from_ints(TOKENS), types.SamplingParams(max_tokens=2)
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()

    monkeypatch.setattr(tinker_rest, "WAIT_S", 0.1)  # the delete answers while it is queued
    with held_worker(server, monkeypatch) as held:
        step = tc.optim_step(types.AdamParams(learning_rate=0.1))
        held.next_queued()
        assert held.started.wait(60)  # the worker is in the step; what follows queues behind it
        before = doomed.sample(prompt, 1, params)
        held.next_queued()
        on_base = base_sampler.sample(prompt, 1, params)
        held.next_queued()
        rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
        held.next_queued()
        after = doomed.sample(prompt, 1, params)
        held.next_queued()
        assert server.worker.queued() == 4
    step.result()
    assert len(before.result().sequences) == 1  # queued before the delete: served
    assert len(on_base.result().sequences) == 1
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        after.result()  # sent after the delete: the checkpoint is gone
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert path not in listed

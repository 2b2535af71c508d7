"""A checkpoint delete is a worker barrier, through the real ``tinker`` SDK: a sample request
sent after the delete of a sampler checkpoint is not batched with those queued before it, so
it is served (or refused) as the store stands after the delete, never by the deleted weights.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from relayrl.model import build_tiny_model  # noqa: E402
from relayrl.tinker import rest as tinker_rest  # noqa: E402
from relayrl.tinker.server import TinkerServer  # noqa: E402
from relayrl.tinker.service import TinkerService  # noqa: E402

KEY = "tml-relayrl-test"
TOKENS = [5, 6, 14, 7, 18, 5, 9]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, TinkerServer]]:
    root = tmp_path_factory.mktemp("tinker-delete-barrier")
    base = build_tiny_model(root / "base", hidden_size=32, max_position_embeddings=64)
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

    queued: queue.Queue[str] = queue.Queue()
    submit = server.worker.submit

    def noting_submit(*args: Any, **kwargs: Any) -> str:
        rid = submit(*args, **kwargs)
        queued.put(rid)
        return rid

    started, release = threading.Event(), threading.Event()
    optim_step = server.service.optim_step

    def held_step(model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        started.set()
        assert release.wait(60)
        return optim_step(model_id, adam)

    monkeypatch.setattr(server.worker, "submit", noting_submit)
    monkeypatch.setattr(server.service, "optim_step", held_step)
    monkeypatch.setattr(tinker_rest, "WAIT_S", 0.1)  # the delete answers while it is queued
    try:
        step = tc.optim_step(types.AdamParams(learning_rate=0.1))
        queued.get(timeout=60)
        assert started.wait(60)  # the worker is in the step; what follows queues behind it
        before = doomed.sample(prompt, 1, params)
        queued.get(timeout=60)
        on_base = base_sampler.sample(prompt, 1, params)
        queued.get(timeout=60)
        rest = tinker.RestClient(base_url=server.base_url(), api_key=KEY)
        rest.delete_checkpoint_from_tinker_path(path).result(timeout=60)
        queued.get(timeout=60)
        after = doomed.sample(prompt, 1, params)
        queued.get(timeout=60)
        assert server.worker.queued() == 4
    finally:
        release.set()
    step.result()
    assert len(before.result().sequences) == 1  # queued before the delete: served
    assert len(on_base.result().sequences) == 1
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        after.result()  # sent after the delete: the checkpoint is gone
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert path not in listed

"""No host round trips on the actor's hot path: a training step reads the device's values on
the host once (its metrics), whatever the number of mini- and micro-batches.

On a GPU every read of a device tensor's value (``float(t)``, ``t.item()``, ``t.tolist()``)
synchronises (``torch.cuda.set_sync_debug_mode`` warns on each). Mirrored on the CPU: the
actor cuts the Experience into mini- / micro-batches on the host (integer and bool tensors:
lengths, masks, counts), and everything computed from the model (logprobs, losses,
statistics, gradient norms) is floating point, so a host read of a floating-point tensor
during ``update`` is what would be a device -> host sync on a GPU. Counted here with a
``TorchDispatchMode`` (``_local_scalar_dense``) and ``Tensor.tolist``, outside the
optimizer's ``step`` (AdamW's step counter is a host tensor unless ``capturable``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relayrl.model import build_tiny_model
from scale_helpers import random_experience, scale_config


class HostReads(TorchDispatchMode):
    """Counts host reads of floating-point tensors' values."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        read = func is torch.ops.aten._local_scalar_dense.default
        if read and args[0].is_floating_point() and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("syncs") / "m", hidden_size=16)


@pytest.mark.parametrize("opts", [("algo.mini_batches=2",), ("algo.mini_batches=1",)])
def test_one_host_read_per_training_step(model_dir, monkeypatch, opts):
    from relayrl.workers.build import build_actor

    cfg = scale_config(model_dir, *opts, "algo.micro_batch_size=2", "algo.entropy_coef=0.01")
    actor = build_actor(cfg, str(model_dir))
    exp = random_experience(model_dir, rows=8)
    exp.old_logprobs = actor.compute_logprobs(exp)
    counter = HostReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(t: torch.Tensor):  # noqa: ANN202 - tolist does not dispatch
        counter.count += int(t.is_floating_point() and not counter.paused)
        return tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    step = actor.optimizer.step

    def uncounted_step(*args, **kwargs):  # noqa: ANN202
        counter.paused = True
        try:
            return step(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(actor.optimizer, "step", uncounted_step)
    with counter:
        stats = actor.update(exp)
    assert stats["actor/optimizer_steps"] >= 1
    assert counter.count == 1, counter.count  # 4 micro-batches: 16+ reads before

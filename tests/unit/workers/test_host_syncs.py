"""No host round trips on the trainers' hot path (actor and critic): a training step reads
the device's values on the host once (its metrics), whatever the number of mini- and
micro-batches.

On a GPU every read of a device tensor's value (``float(t)``, ``t.item()``, ``t.tolist()``)
synchronises (``torch.cuda.set_sync_debug_mode`` warns on each). Mirrored on the CPU: the
actor cuts the Experience into mini- / micro-batches on the host (integer and bool tensors:
lengths, masks, counts), and everything computed from the model (logprobs, losses,
statistics, gradient norms) is floating point, so a host read of a floating-point tensor
during ``update`` is what would be a device -> host sync on a GPU. Counted here with a
``TorchDispatchMode`` (``relayrl.telemetry.host_syncs.HostReads``: ``_local_scalar_dense``,
copies to the host, ``Tensor.tolist``), outside the optimizer's ``step`` (AdamW's step counter is
a host tensor unless ``capturable``). The same counter runs in the prepared GPU run's
``hot_path`` step (tools/device_hot_path.py)."""

from __future__ import annotations

import pytest

from relayrl.model import build_tiny_model
from relayrl.telemetry.host_syncs import HostReads
from scale_helpers import random_experience, scale_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("syncs") / "m", hidden_size=16)


@pytest.mark.parametrize("opts", [("algo.mini_batches=2",), ("algo.mini_batches=1",)])
def test_one_host_read_per_training_step(model_dir, opts):
    from relayrl.workers.build import build_actor

    cfg = scale_config(model_dir, *opts, "algo.micro_batch_size=2", "algo.entropy_coef=0.01")
    actor = build_actor(cfg, str(model_dir))
    exp = random_experience(model_dir, rows=8)
    exp.old_logprobs = actor.compute_logprobs(exp)
    counter = HostReads()  # floating-point reads, Tensor.tolist included
    step = vars(actor.optimizer).get("step")  # the LR scheduler's wrapper, if any
    undo = counter.pause_method(actor.optimizer, "step")
    try:
        with counter:
            stats = actor.update(exp)
    finally:
        undo()
    assert stats["actor/optimizer_steps"] >= 1
    assert counter.count == 1, (counter.count, counter.sites)  # 4 micro-batches: 16+ before
    assert counter.paused_count >= 1  # AdamW's step reads its host step counter: seen, set apart
    assert vars(actor.optimizer).get("step") is step  # undone


@pytest.mark.parametrize("opts", [("algo.mini_batches=2",), ("algo.mini_batches=1",)])
def test_one_host_read_per_critic_update(model_dir, opts):
    """The critic's update as the actor's: micro-batches move to the model's device, losses,
    statistics and gradient norms stay there, one read at the end (vf_loss, grad_norm and the
    statistics together)."""
    import torch

    from fsdp_ranks import critic_experience
    from relayrl.workers.build import build_critic

    cfg = scale_config(model_dir, *opts, "algo.name=ppo", "algo.micro_batch_size=2")
    critic = build_critic(cfg, str(model_dir))
    exp = critic_experience(model_dir)
    exp.values = exp.values.float()
    exp.returns = exp.returns.float()
    counter = HostReads()
    undo = counter.pause_method(critic.optimizer, "step")
    try:
        with counter:
            stats = critic.update(exp)
    finally:
        undo()
    assert counter.count == 1, (counter.count, counter.sites)  # 3 per micro-batch before
    assert stats["critic/grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["critic/vf_loss"]))
    assert {"critic/vf_clipfrac", "critic/vpred_mean"} <= stats.keys()

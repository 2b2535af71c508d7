"""The prepared GPU run's ``hot_path`` step (tools/device_run.py): no host round trips on the
actor's and the critic's hot paths, and a colocated engine's weights loaded device to device.

The counters are ``relayrl.telemetry.host_syncs``'s, the same as tests/unit/workers/
test_host_syncs.py's CPU mirror:

- ``update_host_syncs``: host reads of floating-point values of tensors on the run's device
  (``HostReads(device_type=<device>)``: ``_local_scalar_dense``, copies to the host,
  ``Tensor.tolist``) during one ``actor.update`` (8 rows: 2 mini-batches of 2 micro-batches
  of 2 rows; ``update_forwards``: the model's forwards counted by a hook), the
  optimizer's ``step`` set apart. On CUDA each such read is a device -> host sync; on the CPU it
  is the mirror (integer / boolean bookkeeping stays on the host, what the model computes is
  floating point). Asserted == 1 on both devices: the step's metrics, read once.
- ``update_cuda_sync_calls`` (CUDA; null on the CPU): every call
  ``torch.cuda.set_sync_debug_mode("warn")`` reports as synchronising during the same update,
  with the ``file:line`` of each (``update_cuda_sync_sites``). It counts more than device ->
  host reads: a blocking host -> device copy synchronises too (the micro-batches cut on the
  host move to the device with ``.to(dev)``; ``torch.as_tensor(<python float>, device=dev)``),
  and a read of a boolean or integer device value (transformers' check that a padding mask is
  all ones, on a micro-batch without padding; the engine step's "at most one per forward") is
  one. Asserted
  only >= ``update_host_syncs`` (each of those reads is a sync: the debug mode is live); the
  sites say what the rest are.
- ``critic_update_host_syncs`` / ``critic_update_cuda_sync_calls``: the same two counts during
  one ``critic.update`` of the same batch (PPO's value model on the same layout; values from
  its own forward, returns = values + advantages). Asserted == 1 (its metrics, read once).
- ``batch_d2h_copies``: copies off the device (``CrossDeviceCopies.leaving``) while
  ``actor.compute_logprobs`` and ``critic.compute_values`` compute the batch's logprobs and
  values (micro-batched): asserted 1 each on CUDA (the assembled batch, once), 0 on the CPU.
- ``update_host_reads_any_dtype``: ``HostReads(floating_only=False)`` on the device: the same
  reads with integer and boolean values (reported). ``update_mask_reads``: those of them in
  transformers' mask building (``masking_utils``): asserted 0 on both devices, the batch's
  rows being ragged so that every micro-batch is padded (``model.attention_masks``: the 4D
  mask is built without transformers' check that the padding mask is all ones).
- ``optimizer``: AdamW's ``capturable`` / ``fused`` / ``foreach`` as relayrl builds it
  (``workers.optim.make_optimizer``: defaults) and the device of its step counters; the reads
  and sync calls inside its ``step`` (``optimizer_step_*``). A step counter on the host is
  read there with ``.item()``: no device sync (on CUDA its reads are not of device tensors).
- ``weight_sync_*``: ``engine.update_weights(actor.state_dict(), version=1)`` into an engine
  on the same device (``workers.build.engine_model``, compute dtype): ``d2h_copies`` (copies
  from the device to another one, ``CrossDeviceCopies.leaving``: asserted 0),
  ``host_syncs`` (``HostReads(floating_only=False)`` on the device: asserted 0),
  ``cuda_sync_calls`` (reported), and every engine weight ``torch.equal`` to the actor's cast
  to the engine's dtype (asserted).
- ``self_checks``: each counter counting a deliberate event on this device: a float
  ``.item()`` (``HostReads``; ``CudaSyncs`` on CUDA) and a copy off the device (to the host on
  CUDA, to ``meta`` on the CPU: ``CrossDeviceCopies``), so that a 0 above can fail.
"""

from __future__ import annotations

from typing import Any

import torch
from device_common import Run, random_batch, run_config, small_llama

from relayrl.telemetry.host_syncs import CrossDeviceCopies, CudaSyncs, HostReads

MASKING = "transformers/masking_utils.py"


def _self_checks(dev: torch.device) -> dict[str, bool]:
    x = torch.ones(4, device=dev)
    with HostReads(device_type=dev.type) as reads:
        x.sum().item()
    out = {"host_reads_item": reads.count == 1}
    with CrossDeviceCopies() as copies:
        x.to("cpu" if dev.type != "cpu" else "meta")
    out["copies_off_device"] = copies.leaving(dev.type) == 1
    if dev.type == "cuda":
        with CudaSyncs() as syncs:
            x.sum().item()
        out["cuda_syncs_item"] = syncs.count == 1
    return out


def _optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    group = opt.param_groups[0]
    steps = {str(s["step"].device) for s in opt.state.values() if "step" in s}
    return {
        "class": type(opt).__name__,
        **{k: group.get(k) for k in ("capturable", "fused", "foreach")},
        "step_counter_devices": sorted(steps),
    }


def _critic_update(path: Any, dev: torch.device, overrides: tuple[str, ...], exp: Any) -> Any:
    """(HostReads, CudaSyncs) of one ``critic.update`` of ``exp`` (the optimizer's ``step`` set
    apart), the update's statistics, and the copies off the device of ``compute_values``."""
    from relayrl.workers.build import build_critic

    extra = ("algo.name=ppo", "algo.mini_batches=2", "algo.micro_batch_size=2")
    critic = build_critic(run_config(path, dev, *overrides, *extra), str(path))
    with CrossDeviceCopies() as copies:
        exp.values = critic.compute_values(exp).float()
    exp.returns = exp.values + exp.advantages
    reads, syncs = HostReads(device_type=dev.type), CudaSyncs()
    undo = [c.pause_method(critic.optimizer, "step") for c in (syncs, reads)]
    try:
        with syncs, reads:
            stats = critic.update(exp)
    finally:
        for u in reversed(undo):
            u()
    return reads, syncs, stats, copies.leaving(dev.type)


def step_hot_path(run: Run) -> dict[str, Any]:
    from relayrl.algos import compute_grpo
    from relayrl.model import load_tokenizer, model_vocab_size
    from relayrl.rollout import RolloutEngine
    from relayrl.workers.build import build_actor, engine_model

    dev, cuda = run.device, run.device.type == "cuda"
    path = small_llama(run)
    overrides = ("model.dtype=bfloat16", "optim.lr=1e-3")
    cfg = run_config(path, dev, *overrides, "algo.mini_batches=2", "algo.micro_batch_size=2")
    actor = build_actor(cfg, str(path))
    exp = random_batch(model_vocab_size(path) or 64, 8, 16, 32, ragged=True)
    # as the trainer: pi_old from the actor's forwards on the device (one transfer to the
    # Experience's home), GRPO advantages of a last-token reward per 4-answer group
    with CrossDeviceCopies() as lp_copies:
        exp.old_logprobs = actor.compute_logprobs(exp)
    mask = exp.response_mask
    g = torch.Generator().manual_seed(3)
    rewards = torch.zeros_like(mask)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(exp)), last] = torch.rand(len(exp), generator=g)
    exp.group_index = torch.arange(len(exp)) // 4
    exp.advantages, _ = compute_grpo(rewards, mask, exp.group_index)

    reads = HostReads(device_type=dev.type)
    reads_any = HostReads(floating_only=False, device_type=dev.type)
    syncs = CudaSyncs()
    undo = [c.pause_method(actor.optimizer, "step") for c in (syncs, reads_any, reads)]
    forwards = [0]
    hook = actor.model.register_forward_pre_hook(
        lambda *_: forwards.__setitem__(0, forwards[0] + 1)
    )
    try:
        with syncs, reads_any, reads:
            stats = actor.update(exp)
    finally:
        hook.remove()
        for u in reversed(undo):
            u()
    c_reads, c_syncs, c_stats, values_d2h = _critic_update(path, dev, overrides, exp)
    # the batch's logprobs / values leave the device once each (none leave the CPU)
    transfers = {"compute_logprobs": lp_copies.leaving(dev.type), "compute_values": values_d2h}
    finite = all(v == v and abs(v) != float("inf") for v in [*stats.values(), *c_stats.values()])

    tok = load_tokenizer(path)
    engine = RolloutEngine(
        engine_model(cfg.model, actor, str(path)),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=8,
    )
    w_syncs = CudaSyncs()
    with w_syncs, CrossDeviceCopies() as copies, HostReads(False, dev.type) as w_reads:
        engine.update_weights(actor.state_dict(), version=1)
    mine = engine.model.state_dict()
    dtype = next(engine.model.parameters()).dtype
    actor_state = actor.state_dict()
    equal = all(
        torch.equal(mine[k], v.to(dtype) if v.is_floating_point() else v)
        for k, v in actor_state.items()
    )
    checks = _self_checks(dev)
    d2h = copies.leaving(dev.type)
    mask_reads = sum(n for s, n in reads_any.sites.items() if s.startswith(MASKING))
    ok = (
        reads.count == 1
        and mask_reads == 0
        and c_reads.count == 1
        and all(n == int(cuda) for n in transfers.values())
        and (not cuda or syncs.count >= reads.count)
        and d2h == 0
        and w_reads.count == 0
        and equal
        and set(mine) == set(actor_state)
        and str(engine.device).startswith(dev.type)
        and finite
        and all(checks.values())
    )
    return {
        "ok": ok,
        "update_forwards": forwards[0],
        "optimizer_steps": int(stats["actor/optimizer_steps"]),
        "update_host_syncs": reads.count,
        "update_host_sync_sites": dict(reads.sites),
        "batch_d2h_copies": transfers,
        "critic_update_host_syncs": c_reads.count,
        "critic_update_host_sync_sites": dict(c_reads.sites),
        "critic_update_cuda_sync_calls": c_syncs.count if cuda else None,
        "critic_update_cuda_sync_sites": dict(c_syncs.sites.most_common(12)) if cuda else None,
        "update_host_reads_any_dtype": reads_any.count,
        "update_host_reads_any_dtype_sites": dict(reads_any.sites.most_common(12)),
        "update_mask_reads": mask_reads,
        "update_cuda_sync_calls": syncs.count if cuda else None,
        "update_cuda_sync_sites": dict(syncs.sites.most_common(12)) if cuda else None,
        "optimizer": _optimizer(actor.optimizer),
        "optimizer_step_host_reads": reads.paused_count,
        "optimizer_step_cuda_sync_calls": syncs.paused_count if cuda else None,
        "weight_sync_d2h_copies": d2h,
        "weight_sync_cross_device_copies": copies.by_pair(),
        "weight_sync_host_syncs": w_reads.count,
        "weight_sync_cuda_sync_calls": w_syncs.count if cuda else None,
        "weight_sync_cuda_sync_sites": dict(w_syncs.sites) if cuda else None,
        "engine_device": str(engine.device),
        "engine_dtype": str(dtype),
        "engine_weights_equal_actor": equal,
        "update_stats_finite": finite,
        "self_checks": checks,
    }

"""FSDP2 (``torch.distributed.fsdp.fully_shard``) actor, critic and reference workers.

Same code on CPU (gloo) and GPU (NCCL): every decoder layer is one FSDP unit, the root holds
embeddings, final norm and head. Parameters, gradients and optimizer state are sharded over
the ranks of the default process group; a layer's parameters are all-gathered for its forward
and freed after it (``model.fsdp.reshard_after_forward``), gradients are reduce-scattered in
the backward. Under ``model.dtype: bfloat16`` the gathered parameters are cast to bf16 and
gradients reduced in fp32 (``MixedPrecisionPolicy``): the sharded fp32 parameters are the
master weights and AdamW's state is fp32.

Two things differ from a replica all-reduce (``relayrl.workers.data_parallel``):

* gradients are SUMMED over ranks (divide factor 1): each rank's loss is already normalised by
  the global token / sequence counts, so the sum is the single-process gradient;
* every forward and backward is a collective, so all ranks must run the same number of them.
  Ranks whose shard has fewer micro-batches (token-budget packing, skipped zero-advantage
  rows) run zero-weighted dummy forwards / backwards on one token (``CollectivePadder``).

The full weights for the rollout engine are gathered parameter by parameter into buckets of
at most ``model.fsdp.sync_bucket_mb`` (``iter_full_state_buckets``): a rank other than 0 never
holds more than one bucket of full tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from relayrl.algos import LossNorm
from relayrl.config import FsdpConfig, RunConfig
from relayrl.model.device import Precision, model_device, set_compute_dtype
from relayrl.model.lora import is_lora, merged_entries, merged_stream
from relayrl.workers.actor import ReferenceWorker
from relayrl.workers.data_parallel import DataParallelActorWorker, DataParallelCriticWorker
from relayrl.workers.experience import Experience


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF model (every module of the first ``*DecoderLayer`` /
    ``*Block`` class found): each becomes one FSDP unit."""
    for module in model.modules():
        if type(module).__name__.endswith(("DecoderLayer", "Block")):
            return [m for m in model.modules() if type(m) is type(module)]
    return []


def shard_model(model: torch.nn.Module, fsdp: FsdpConfig, precision: Precision) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; gradients summed (not averaged)."""
    mp = (
        MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
        if precision.mixed
        else MixedPrecisionPolicy()
    )
    # pinned host memory needs an accelerator; on a CPU-only machine the offload keeps the
    # shards where they already are (the code path runs, nothing moves)
    pin = torch.cuda.is_available()
    offload = CPUOffloadPolicy(pin_memory=pin) if fsdp.cpu_offload else OffloadPolicy()
    kwargs: dict[str, Any] = dict(
        reshard_after_forward=fsdp.reshard_after_forward, mp_policy=mp, offload_policy=offload
    )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    set_compute_dtype(model, None)  # the policy casts; no autocast on top
    return model


class CollectivePadder:
    """Pads every rank to the same number of forwards (FSDP collectives) with dummy passes.

    ``plan(n)`` is called before a phase with this rank's number of forwards (an all-reduce MAX
    that every rank reaches before any forward); after the real forwards ``pad`` runs the
    missing ones on one token, so every rank issues the same collectives in the same order.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.count = 0
        self.target = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any) -> None:
        self.count += 1

    def plan(self, forwards: int) -> int:
        """Agree on the phase's number of forwards (the busiest rank's); resets the count."""
        n = torch.tensor([forwards], dtype=torch.long)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        self.count, self.target = 0, int(n)
        return self.target

    def pad(self, backward: bool) -> int:
        """Run the dummy passes missing to the planned count; with ``backward`` each is
        followed by a zero-weighted backward. Returns how many ran."""
        missing = self.target - self.count
        if missing < 0:
            raise RuntimeError(f"{self.count} forwards ran, {self.target} were planned")
        dev = model_device(self.model)
        ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
        for _ in range(missing):
            with torch.set_grad_enabled(backward):
                out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
                if backward:
                    (out.logits.float().sum() * 0.0).backward()
        self.count = self.target = 0
        return missing


def _count_micro(exp: Experience, size: int, tokens: int | None) -> int:
    return sum(1 for _ in exp.micro_batches(size, tokens)) if len(exp) else 0


def _full(norm: Tensor) -> Tensor:
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def iter_full_tensors(
    model: torch.nn.Module, to_cpu: bool = True, merged: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """The model's state dict as full tensors, one at a time, in ``state_dict`` order (each
    sharded one all-gathered when reached). A LoRA (peft) model with ``merged``: the engine's
    weights, each adapted weight merged (``relayrl.model.lora.merged_stream``) under the base
    model's keys; without: the peft model's own keys (the adapter checkpoint). A
    collective: every rank must iterate."""

    def raw() -> Iterator[tuple[str, Tensor]]:
        for name, value in model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            full = full.detach()
            yield name, full.cpu() if to_cpu else full

    if merged and is_lora(model):
        yield from merged_stream(model, raw())
    else:
        yield from raw()


def engine_entries(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of ``iter_full_tensors(model)`` without gathering anything."""
    if is_lora(model):
        return merged_entries(model)
    return {k: (tuple(int(d) for d in v.shape), v.dtype) for k, v in model.state_dict().items()}


def iter_full_state_buckets(
    model: torch.nn.Module, bucket_bytes: int, to_cpu: bool = True, merged: bool = True
) -> Iterator[dict[str, Tensor]]:
    """The model's state dict as full tensors, in buckets of at most ``bucket_bytes`` (one
    tensor larger than that is a bucket alone). A collective: every rank must iterate."""
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, full in iter_full_tensors(model, to_cpu, merged):
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = full
        size += nbytes
    if bucket:
        yield bucket


def full_state_dict(
    model: torch.nn.Module, bucket_bytes: int, keep: bool | None = None, merged: bool = True
) -> dict[str, Tensor]:
    """The full state dict (``merged``: see ``iter_full_tensors``), gathered bucket by bucket;
    ranks with ``keep`` False (default: all but rank 0) drop each bucket and return ``{}``."""
    keep = dist.get_rank() == 0 if keep is None else keep
    out: dict[str, Tensor] = {}
    for bucket in iter_full_state_buckets(model, bucket_bytes, merged=merged):
        if keep:
            out.update(bucket)
    return out


# --------------------------------------------------------------------------- sharded checkpoints
# Layout: ``<dir>/`` holds one DCP checkpoint (each rank writes its own shards of every role's
# parameters and optimizer state, plus ``.metadata``) and ``rank_<r>.pt`` per rank with what is
# not sharded: the LR scheduler and the shuffling generator of each role. Loading reshards to
# the ranks that load (same world size for an exact resume). All ranks must call both.
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _sharded_state(roles: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "model": get_model_state_dict(w.model),
            "optim": get_optimizer_state_dict(w.model, w.optimizer),
        }
        for name, w in roles.items()
    }


def save_sharded(out_dir: str | Path, roles: Mapping[str, Any]) -> Path:
    """Save ``roles`` (name -> trainable worker with ``model``, ``optimizer``, ``scheduler``,
    ``generator``) as a sharded checkpoint in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(roles), checkpoint_id=str(out))
    extra = {
        name: {"scheduler": w.scheduler.state_dict(), "generator": w.generator.get_state()}
        for name, w in roles.items()
    }
    torch.save(extra, out / f"rank_{_rank()}.pt")
    if dist.is_initialized():
        dist.barrier()
    return out


def load_sharded(in_dir: str | Path, roles: Mapping[str, Any]) -> None:
    """Load a ``save_sharded`` checkpoint into freshly built ``roles`` (same names)."""
    src = Path(in_dir)
    if not (src / ".metadata").is_file():
        raise FileNotFoundError(f"{src}: not a sharded checkpoint (no .metadata)")
    state = _sharded_state(roles)
    dcp.load(state, checkpoint_id=str(src))
    extra = torch.load(src / f"rank_{_rank()}.pt", weights_only=False)
    for name, w in roles.items():
        set_model_state_dict(w.model, state[name]["model"])
        set_optimizer_state_dict(w.model, w.optimizer, state[name]["optim"])
        w.scheduler.load_state_dict(extra[name]["scheduler"])
        w.generator.set_state(extra[name]["generator"])


class ShardedCheckpointing:
    """``save_sharded`` / ``load_sharded`` of one trainable FSDP2 role (``sharded`` True): a
    ``torch.distributed.checkpoint`` directory of its parameters and optimizer state plus
    each rank's scheduler and generator (``relayrl.controller.sharded_checkpoint``). Every
    rank must call (collectives)."""

    sharded = True

    def save_sharded(self, out_dir: str) -> None:
        save_sharded(out_dir, {"role": self})

    def load_sharded(self, in_dir: str) -> None:
        load_sharded(in_dir, {"role": self})


class FsdpActorWorker(ShardedCheckpointing, DataParallelActorWorker):
    """The data-parallel actor with FSDP2-sharded parameters, gradients and optimizer state."""

    sync_bucket_bytes: int = 256 << 20

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> FsdpActorWorker:
        from relayrl.model.device import precision_for

        shard_model(model, cfg.model.fsdp, precision_for(cfg.model, trainable=True))
        worker = super().from_config(model, cfg)
        assert isinstance(worker, FsdpActorWorker)
        worker.sync_bucket_bytes = int(cfg.model.fsdp.sync_bucket_mb * (1 << 20))
        return worker

    @property
    def padder(self) -> CollectivePadder:
        if not hasattr(self, "_padder"):
            self._padder = CollectivePadder(self.model)
        return self._padder

    def compute_logprobs(self, exp: Experience) -> Tensor:
        self.padder.plan(_count_micro(exp, self.micro_batch_size, self.micro_batch_tokens))
        out = super().compute_logprobs(exp)
        self.padder.pad(backward=False)
        return out

    def _loss_norm(self, mini: Experience) -> LossNorm:
        """The global normaliser, and the mini-batch's forward count agreed over ranks."""
        trained = self._rows_with_gradient(mini)
        a = self.algo
        n = _count_micro(trained, a.micro_batch_size, a.micro_batch_tokens) if len(trained) else 0
        self.padder.plan(n)
        return super()._loss_norm(mini)

    def _reduce_gradients(self) -> None:
        self.padder.pad(backward=True)  # FSDP reduce-scattered in each backward

    def _clip_and_step(self) -> Tensor:
        self._reduce_gradients()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm)).detach()
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def state_dict(self) -> dict[str, Tensor]:
        """Full tensors on rank 0 (``{}`` elsewhere): every rank must call (a collective)."""
        return full_state_dict(self.model, self.sync_bucket_bytes)


class FsdpReferenceWorker(ReferenceWorker):
    """A frozen sharded reference (bf16 parameters under ``model.dtype: bfloat16``)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> FsdpReferenceWorker:
        from relayrl.model.device import precision_for

        shard_model(model, cfg.model.fsdp, precision_for(cfg.model, trainable=False))
        worker = super().from_config(model, cfg)
        assert isinstance(worker, FsdpReferenceWorker)
        return worker

    def compute_logprobs(self, exp: Experience) -> Tensor:
        padder = getattr(self, "_padder", None) or CollectivePadder(self.model)
        self._padder = padder
        padder.plan(_count_micro(exp, self.micro_batch_size, self.micro_batch_tokens))
        out = super().compute_logprobs(exp)
        padder.pad(backward=False)
        return out


class FsdpCriticWorker(ShardedCheckpointing, DataParallelCriticWorker):
    """The data-parallel critic with FSDP2-sharded parameters, gradients and optimizer state."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> FsdpCriticWorker:
        from relayrl.model.device import precision_for

        shard_model(model, cfg.model.fsdp, precision_for(cfg.model, trainable=True))
        return cls(model, cfg.algo, cfg.optim, cfg.seed)

    @property
    def padder(self) -> CollectivePadder:
        if not hasattr(self, "_padder"):
            self._padder = CollectivePadder(self.model)
        return self._padder

    def compute_values(self, exp: Experience) -> Tensor:
        a = self.algo
        self.padder.plan(_count_micro(exp, a.micro_batch_size, a.micro_batch_tokens))
        out = super().compute_values(exp)
        self.padder.pad(backward=False)
        return out

    def _loss_norm(self, mini: Experience) -> LossNorm:
        a = self.algo
        self.padder.plan(_count_micro(mini, a.micro_batch_size, a.micro_batch_tokens))
        return super()._loss_norm(mini)

    def _reduce_gradients(self) -> None:
        self.padder.pad(backward=True)

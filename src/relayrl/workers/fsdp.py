"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as the parallelism of a worker: ``Fsdp2Sharded``.

Same code on CPU (gloo) and GPU (NCCL): every decoder layer is one FSDP unit, the root holds
embeddings, final norm and head. Parameters, gradients and optimizer state are sharded over
the ranks of the default process group; a layer's parameters are all-gathered for its forward
and freed after it (``model.fsdp.reshard_after_forward``), gradients are reduce-scattered in
the backward. Under ``model.dtype: bfloat16`` the gathered parameters are cast to bf16 and
gradients reduced in fp32 (``MixedPrecisionPolicy``): the sharded fp32 parameters are the
master weights and AdamW's state is fp32.

Two things differ from a replica all-reduce (``relayrl.workers.data_parallel``, whose
mini-batch parts and global loss counts it shares):

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

from collections.abc import Callable, Iterator, Mapping
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

from relayrl.config import FsdpConfig
from relayrl.model.device import Precision, model_device, set_compute_dtype
from relayrl.model.lora import is_lora, merged_entries, merged_stream
from relayrl.workers.data_parallel import ReplicatedDataParallel


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
    agree(out, lambda: out.mkdir(parents=True, exist_ok=True))
    agree(out, lambda: dcp.save(_sharded_state(roles), checkpoint_id=str(out)))
    extra = {
        name: {"scheduler": w.scheduler.state_dict(), "generator": w.generator.get_state()}
        for name, w in roles.items()
    }
    agree(out, lambda: torch.save(extra, out / f"rank_{_rank()}.pt"))
    return out


class ShardedWriteError(OSError):
    """Some rank could not write its part of a sharded checkpoint: raised on every rank alike
    (``strerror``: the rank, the folder and the cause, one line)."""


def _cause(exc: BaseException, rank: int) -> tuple[int, int | None, str]:
    """The failed rank, errno and first line of ``exc``; of the first failed rank's exception
    when it is DCP's ``CheckpointException`` (a BaseException raised on every rank, whose text
    is every failed rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items())))
        exc = inner[0] if isinstance(inner, tuple) else inner
    if isinstance(exc, OSError):
        return rank, exc.errno, exc.strerror or str(exc)
    text = str(exc).strip()
    return rank, None, text.splitlines()[0] if text else type(exc).__name__


def agree(out: Path, write: Callable[[], object]) -> None:
    """Run ``write`` on this rank, then learn every rank's outcome (``all_gather_object``): a
    failure on any rank raises the same :class:`ShardedWriteError` on every rank, so none is
    left waiting in the next collective (the gloo / NCCL timeout, 30 minutes by default)."""
    from torch.distributed.checkpoint.api import CheckpointException

    err: BaseException | None = None
    try:
        write()
    except (Exception, CheckpointException) as exc:
        err = exc
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = None if err is None else _cause(err, _rank())
    outcomes: list[tuple[int, int | None, str] | None] = [mine] * world
    if world > 1:
        dist.all_gather_object(outcomes, mine)
    for cause in outcomes:
        if cause is not None:
            rank, code, words = cause
            raise ShardedWriteError(
                code or 0, f"rank {rank} could not write its part of {out.name}: {words}"
            ) from err


def load_sharded(in_dir: str | Path, roles: Mapping[str, Any]) -> None:
    """Load a ``save_sharded`` checkpoint into freshly built ``roles`` (same names), at the
    world size it was written with or another one: DCP reshards parameters and optimizer
    state to the loading ranks, and the rest (LR scheduler, shuffling generator) is the same
    on every rank (seeded alike, stepped alike), so a rank the checkpoint has no
    ``rank_<r>.pt`` for (more ranks than wrote it) takes rank 0's."""
    src = Path(in_dir)
    if not (src / ".metadata").is_file():
        raise FileNotFoundError(f"{src}: not a sharded checkpoint (no .metadata)")
    own = src / f"rank_{_rank()}.pt"
    if not own.is_file() and not (src / "rank_0.pt").is_file():
        raise FileNotFoundError(f"{src}: no rank_0.pt (the scheduler and generator states)")
    state = _sharded_state(roles)
    dcp.load(state, checkpoint_id=str(src))
    extra = torch.load(own if own.is_file() else src / "rank_0.pt", weights_only=False)
    for name, w in roles.items():
        set_model_state_dict(w.model, state[name]["model"])
        set_optimizer_state_dict(w.model, w.optimizer, state[name]["optim"])
        w.scheduler.load_state_dict(extra[name]["scheduler"])
        w.generator.set_state(extra[name]["generator"])


class Fsdp2Sharded(ReplicatedDataParallel):
    """One rank of an FSDP2 group: parameters, gradients and optimizer state sharded
    (``shard_model``), the same forward count on every rank (``CollectivePadder``), full
    weights gathered in buckets of ``fsdp.sync_bucket_mb``, sharded checkpoints. One
    instance per model: it holds that model's padder (a LoRA actor's adapter-disabled
    reference shares the actor's)."""

    sharded = True

    def __init__(self, fsdp: FsdpConfig):
        self.fsdp = fsdp
        self.bucket_bytes = int(fsdp.sync_bucket_mb * (1 << 20))
        self._padder: CollectivePadder | None = None

    def wrap(self, model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
        return shard_model(model, self.fsdp, precision)

    def padder(self, model: torch.nn.Module) -> CollectivePadder:
        """The model's padder (made, and its forward hook registered, on first use)."""
        if self._padder is None:
            self._padder = CollectivePadder(model)
        if self._padder.model is not model:
            raise ValueError("one Fsdp2Sharded per model: this one pads another model")
        return self._padder

    def plan_forwards(self, model: torch.nn.Module, count: Callable[[], int]) -> None:
        self.padder(model).plan(count())

    def pad_forwards(self, model: torch.nn.Module, backward: bool) -> None:
        self.padder(model).pad(backward)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        self.pad_forwards(model, backward=True)  # FSDP reduce-scattered in each backward

    def full_state_dict(
        self, model: torch.nn.Module, merged: bool = True, keep: bool | None = None
    ) -> dict[str, Tensor]:
        """Full tensors on rank 0 (``keep``), ``{}`` elsewhere: every rank must call."""
        return full_state_dict(model, self.bucket_bytes, keep, merged)

    def save_sharded(self, out_dir: str, roles: Mapping[str, Any]) -> None:
        save_sharded(out_dir, roles)

    def load_sharded(self, in_dir: str, roles: Mapping[str, Any]) -> None:
        load_sharded(in_dir, roles)

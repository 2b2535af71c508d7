"""How a role runs over processes: the ``Parallelism`` strategy each worker holds.

A worker (``ActorWorker``, ``ReferenceWorker``, ``CriticWorker``) is one class whatever the
parallelism; what differs between one process, replicated data parallel and FSDP2 is asked of
the strategy object it holds:

* ``wrap``: how the model is prepared (FSDP2: ``fully_shard`` per decoder layer and root);
* ``mini_batches``: this process's part of each global mini-batch of the step;
* ``loss_norm``: the step-global token / sequence counts of the loss normaliser (summed over
  ranks with ``all_reduce`` under data parallelism);
* ``plan_forwards`` / ``pad_forwards``: collective padding (FSDP2: every forward is a
  collective, so every rank runs the busiest rank's number of forwards);
* ``reduce_sums``: the sums behind an update's statistics (and their weights) over the ranks,
  so a weighted mean is the global one, not an average of the ranks' means (and the maxima
  of its ``*_max`` statistics, their maximum);
* ``reduce_gradients``: before clipping (replicas: one all-reduce SUM; FSDP2: reduce-scattered
  in each backward, the dummy backwards of padding here);
* ``full_state_dict``: the full weights (FSDP2: gathered bucket by bucket, rank 0 keeps them);
  with ``merged`` a LoRA model's weights are the merged ones (the engine's);
* ``save_sharded`` / ``load_sharded``: the sharded checkpoint (FSDP2 only, ``sharded`` True).

``SingleProcess`` is here; ``ReplicatedDataParallel`` is in ``relayrl.workers.data_parallel``
and ``Fsdp2Sharded`` in ``relayrl.workers.fsdp``; ``relayrl.workers.build`` picks one from the
config (``parallelism_for``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from relayrl.algos import LossNorm
from relayrl.model.lora import is_lora, merged_state_dict
from relayrl.workers.experience import Experience


def count_micro_batches(exp: Experience, size: int, tokens: int | None) -> int:
    """How many micro-batches (forwards) ``exp.micro_batches(size, tokens)`` yields."""
    return sum(1 for _ in exp.micro_batches(size, tokens)) if len(exp) else 0


def full_tensor(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective); a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def clip_and_step(
    parallelism: Parallelism,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float | None,
) -> Tensor:
    """One optimizer step: the gradients reduced over ranks, clipped to a global L2 norm of
    ``grad_clip`` (None: not clipped), the optimizer and LR scheduler stepped. Returns the
    global gradient norm before clipping, ||g||_2 over every parameter with a gradient (a
    0-d device tensor: no host read)."""
    parallelism.reduce_gradients(model)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip is not None else float("inf")
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)).detach()
    optimizer.step()
    scheduler.step()
    return grad_norm


class Parallelism:
    """The strategy interface, with the one-process behaviour: no collectives anywhere."""

    distributed = False
    """Whether the role runs over a process group (its ranks must call collectives together)."""
    sharded = False
    """Whether parameters and optimizer state are sharded (FSDP2): checkpoints are sharded."""

    def wrap(self, model: torch.nn.Module, precision: Any) -> torch.nn.Module:
        """The model as the role trains / runs it (``precision``: ``model.device.Precision``)."""
        return model

    def mini_batches(self, exp: Experience, n: int, generator: torch.Generator) -> list[Experience]:
        """This process's parts of the epoch's ``n`` mini-batches (one draw of ``generator``)."""
        return exp.shuffled_splits(n, generator)

    def loss_norm(
        self, mask: Tensor, mode: str, norm_constant: float, count_empty_rows: bool
    ) -> LossNorm:
        """The step-global normaliser of a mini-batch whose response mask here is ``mask``."""
        return LossNorm.for_batch(mask, mode, norm_constant, count_empty_rows)

    def plan_forwards(self, model: torch.nn.Module, count: Callable[[], int]) -> None:
        """Before a phase of forwards: ``count()`` is this process's number of them."""

    def pad_forwards(self, model: torch.nn.Module, backward: bool) -> None:
        """After the phase's forwards (and backwards, with ``backward``): the missing ones."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Before clipping: every rank's gradient becomes the global one."""

    def reduce_sums(
        self, sums: Mapping[str, float], maxes: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """``sums`` summed over the ranks, for every key any rank has (missing: 0), and
        ``maxes`` (keys other than the sums') their maximum over the ranks that have them, in
        one dict; every rank gets the same dict. One process: both as they are."""
        return {**sums, **(maxes or {})}

    def full_state_dict(
        self, model: torch.nn.Module, merged: bool = True, keep: bool | None = None
    ) -> dict[str, Tensor]:
        """The full state dict; ``merged``: a LoRA model's adapters merged into the base
        weights under the base model's keys (the rollout engine's weights). ``keep``: whether
        this rank keeps the gathered tensors (sharded strategies only)."""
        if merged and is_lora(model):
            return merged_state_dict(model)
        return model.state_dict()

    def save_sharded(self, out_dir: str, roles: Mapping[str, Any]) -> None:
        raise ValueError(f"{type(self).__name__}: no sharded checkpoint (model.fsdp.enabled)")

    def load_sharded(self, in_dir: str, roles: Mapping[str, Any]) -> None:
        raise ValueError(f"{type(self).__name__}: no sharded checkpoint (model.fsdp.enabled)")


class SingleProcess(Parallelism):
    """One process holds the whole model and trains on the whole batch."""

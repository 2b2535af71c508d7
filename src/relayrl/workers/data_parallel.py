"""Replicated data parallelism (``ReplicatedDataParallel``): each rank holds the whole model and
trains on its shard of the batch; gradients summed over ranks.

The global batch is cut into mini-batches before it is sharded (veRL's dispatch): a rank's
shard is a contiguous block of rows of the global batch, in rank order (what the worker
group's ``split_experience`` sends), every rank draws the same permutation of the GLOBAL
row count, and each mini-batch on a rank is that mini-batch's rows that fall in its block
(``rank_mini_batches``). N ranks so train exactly what one process trains for every
``algo.mini_batches``, micro-batch size and loss aggregation.

The loss of every rank is normalised by the GLOBAL token / sequence counts of the optimizer
step (summed over ranks with ``all_reduce``), so rank losses add up to the loss of the whole
batch and the summed gradient equals the single-process gradient whatever the split.
Gradients are all-reduced (SUM) with ``torch.distributed`` (gloo on CPU; NCCL on GPU) before
clipping, so every rank clips the same global norm and takes the same optimizer step.
The statistics an update returns are global too: the token-weighted sums behind a mean and
their weights are summed over ranks (``all_reduce_sums``) before the division, so every rank
returns sum_r S_r / sum_r W_r (what one process computes on the whole batch), not its own
shard's mean; a ``*_max`` statistic is the maximum over ranks.
Every rank runs the same number of optimizer steps (one per non-empty global mini-batch),
also when its part of a mini-batch is empty, or its whole shard is (a step with fewer
sequences than ranks, after dynamic sampling or filtering dropped groups): its gradient is
zero and it joins every collective (FSDP2: zero-weighted dummy passes), so the step trains
what one process trains on the whole batch.

With ``model.fsdp.enabled`` ``relayrl.workers.build`` gives the workers ``Fsdp2Sharded`` of
``relayrl.workers.fsdp`` instead (sharded state, reduce-scatter instead of the all-reduce).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from relayrl.algos import LossNorm
from relayrl.algos.aggregation import step_counts
from relayrl.workers.experience import Experience
from relayrl.workers.parallel import Parallelism


def split_experience(exp: Experience, n: int) -> list[Experience]:
    """Contiguous near-equal blocks of rows, one per data-parallel rank, in rank order (the
    worker group's dispatch). Fewer rows than ranks (dynamic sampling or filtering dropped
    groups mid-run) leaves the last ranks an empty block: they still join every collective of
    the step (``rank_mini_batches`` gives them empty parts; FSDP2 pads their forwards), so the
    step trains what one process trains on the whole batch."""
    bounds = torch.arange(len(exp)).tensor_split(n)
    return [exp.select(b) for b in bounds]


def shard_position(rows: int) -> tuple[int, int]:
    """(offset of this rank's block in the global batch, global row count): the blocks are
    contiguous in rank order. One small all-reduce."""
    sizes = torch.zeros(dist.get_world_size(), dtype=torch.long)
    sizes[dist.get_rank()] = rows
    dist.all_reduce(sizes, op=dist.ReduceOp.SUM)
    return int(sizes[: dist.get_rank()].sum()), int(sizes.sum())


def rank_mini_batches(exp: Experience, n: int, generator: torch.Generator) -> list[Experience]:
    """This rank's parts of the ``n`` global mini-batches (see the module docstring)."""
    offset, total = shard_position(len(exp))
    return exp.shuffled_splits(n, generator, offset, total)


def all_reduce_sums(
    sums: Mapping[str, float], maxes: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Each key's value of ``sums`` summed over ranks (float64), for the union of the ranks'
    keys (a rank whose parts were all empty has not seen every statistic), and each key of
    ``maxes`` its maximum over the ranks that have it, in one dict: one ``all_gather_object``
    of the key lists (and the few maxima) and one ``all_reduce``. Every rank must call."""
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, (sorted(sums), dict(maxes or {})))
    keys = sorted({k for ks, _ in lists for k in ks})
    values = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out = dict(zip(keys, values.tolist(), strict=True))
    for _, top in lists:
        for k, v in top.items():
            out[k] = max(out.get(k, v), float(v))
    return out


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum the gradients of ``model`` over ranks (one flat collective, not one per tensor)."""
    grads: list[torch.Tensor] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is None:  # a parameter unused on this rank still joins the collective
            g = p.grad = torch.zeros_like(p)
        grads.append(g)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


class ReplicatedDataParallel(Parallelism):
    """One rank of an initialised default process group holding a replica of the model: the
    rank's parts of the global mini-batches, the global loss counts, gradients all-reduced."""

    distributed = True

    def mini_batches(self, exp: Experience, n: int, generator: torch.Generator) -> list[Experience]:
        return rank_mini_batches(exp, n, generator)

    def loss_norm(
        self, mask: torch.Tensor, mode: str, norm_constant: float, count_empty_rows: bool
    ) -> LossNorm:
        """The counts of ``step_counts`` (the single-process convention), summed over ranks."""
        counts = torch.tensor(step_counts(mask, count_empty_rows), dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return LossNorm(mode, float(counts[0]), float(counts[1]), float(norm_constant))

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        all_reduce_gradients(model)

    def reduce_sums(
        self, sums: Mapping[str, float], maxes: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        return all_reduce_sums(sums, maxes)

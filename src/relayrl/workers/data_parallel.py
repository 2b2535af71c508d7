"""Data-parallel actor and critic: each rank trains on its shard; gradients summed over ranks.

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
Every rank runs the same number of optimizer steps (one per non-empty global mini-batch),
also when its part of a mini-batch is empty.

With ``model.fsdp.enabled`` ``relayrl.workers.build`` builds the FSDP2 workers of
``relayrl.workers.fsdp`` instead (sharded state, reduce-scatter instead of the all-reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relayrl.algos import LossNorm
from relayrl.algos.aggregation import step_counts
from relayrl.workers.actor import ActorWorker
from relayrl.workers.critic import CriticWorker
from relayrl.workers.experience import Experience


def global_loss_norm(
    mini: Experience, mode: str, norm_constant: float = 1.0, count_empty_rows: bool = True
) -> LossNorm:
    """``LossNorm`` with token and sequence counts summed over all data-parallel ranks (each
    rank's counted by ``step_counts``, the single-process actor's convention)."""
    counts = torch.tensor(step_counts(mini.response_mask, count_empty_rows), dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return LossNorm(mode, float(counts[0]), float(counts[1]), float(norm_constant))


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


def all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum the gradients of ``model`` over ranks (one flat collective, not one per tensor)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # a parameter unused on this rank still joins the collective
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


class DataParallelActorWorker(ActorWorker):
    """``ActorWorker`` on one rank of an initialised default process group."""

    def _mini_batches(self, exp: Experience) -> list[Experience]:
        return rank_mini_batches(exp, self.algo.mini_batches, self.generator)

    def _loss_norm(self, mini: Experience) -> LossNorm:
        empty = self.algo.seq_mean_empty_rows == "count"
        return global_loss_norm(mini, self.algo.loss_agg, self.max_response_tokens, empty)

    def _reduce_gradients(self) -> None:
        all_reduce_gradients(self.model)


class DataParallelCriticWorker(CriticWorker):
    """``CriticWorker`` on one rank of an initialised default process group."""

    def _mini_batches(self, exp: Experience) -> list[Experience]:
        return rank_mini_batches(exp, self.algo.mini_batches, self.generator)

    def _loss_norm(self, mini: Experience) -> LossNorm:
        empty = self.algo.seq_mean_empty_rows == "count"
        return global_loss_norm(mini, self.algo.loss_agg, 1.0, empty)

    def _reduce_gradients(self) -> None:
        all_reduce_gradients(self.model)

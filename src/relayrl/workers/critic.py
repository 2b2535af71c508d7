"""Critic role: V(s_t) per response token and the clipped value-loss update.

One class whatever the parallelism: it holds a ``Parallelism`` strategy
(``relayrl.workers.parallel``) as the actor does (no LoRA option).
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch import Tensor

from relayrl.algos import LossNorm, clipped_value_loss
from relayrl.algos.masked import deferred_stats, host_floats
from relayrl.config import AlgoConfig, OptimConfig, RunConfig
from relayrl.model import forward_values
from relayrl.model.batching import output_dtype
from relayrl.model.device import model_device
from relayrl.workers.experience import Experience
from relayrl.workers.optim import load_train_state, make_optimizer, train_state
from relayrl.workers.parallel import (
    Parallelism,
    SingleProcess,
    clip_and_step,
    count_micro_batches,
)

_TOKENS = "_tokens"
_LOSS = "_loss"
_GRAD_NORM = "_grad_norm"


class CriticWorker:
    def __init__(
        self,
        model: torch.nn.Module,
        algo: AlgoConfig,
        optim: OptimConfig,
        seed: int = 0,
        parallelism: Parallelism | None = None,
        max_response_tokens: int = 1,
    ):
        self.model = model
        self.algo = algo
        self.max_response_tokens = max_response_tokens  # Dr.GRPO's constant, as the actor's
        self.grad_clip = optim.grad_clip
        self.parallelism = parallelism if parallelism is not None else SingleProcess()
        self.optimizer, self.scheduler = make_optimizer(
            list(model.parameters()),
            optim.critic_lr,
            optim.weight_decay,
            optim.betas,
            optim.warmup_steps,
        )
        self.generator = torch.Generator().manual_seed(seed + 1)

    @classmethod
    def from_config(
        cls, model: torch.nn.Module, cfg: RunConfig, parallelism: Parallelism | None = None
    ) -> CriticWorker:
        """The critic of a run: algorithm, optimizer, seed and response limit from ``cfg``."""
        return cls(model, cfg.algo, cfg.optim, cfg.seed, parallelism, cfg.rollout.max_tokens)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over ranks (FSDP2): checkpoints are collectives."""
        return self.parallelism.sharded

    def train_state(self) -> dict[str, Any]:
        """Optimizer, LR scheduler and shuffling generator (a replicated role's checkpoint)."""
        return train_state(self.optimizer, self.scheduler, self.generator)

    def load_train_state(self, state: dict[str, Any]) -> None:
        load_train_state(state, self.optimizer, self.scheduler, self.generator)

    def save_sharded(self, out_dir: str) -> None:
        """A sharded (FSDP2) checkpoint of this role; every rank must call."""
        self.parallelism.save_sharded(out_dir, {"role": self})

    def load_sharded(self, in_dir: str) -> None:
        self.parallelism.load_sharded(in_dir, {"role": self})

    def _count(self, exp: Experience) -> int:
        return count_micro_batches(exp, self.algo.micro_batch_size, self.algo.micro_batch_tokens)

    @torch.no_grad()
    def compute_values(self, exp: Experience) -> Tensor:
        """V(s_t) of every response token, 0 elsewhere (eval mode, micro-batched); each
        micro-batch's values stay on the model's device until the whole batch is done, then
        reach ``exp``'s device in one transfer."""
        self.parallelism.plan_forwards(self.model, lambda: self._count(exp))
        self.model.eval()
        a = self.algo
        dev = model_device(self.model)
        parts = [
            (idx, forward_values(self.model, mb.to(dev).batch))
            for idx, mb in exp.micro_batches(a.micro_batch_size, a.micro_batch_tokens)
        ]
        values = exp.scatter_tokens(parts, output_dtype(self.model))  # 0 rows: no parts
        self.parallelism.pad_forwards(self.model, backward=False)
        return values.to(exp.response_mask.device) * exp.response_mask  # one transfer

    def update(self, exp: Experience) -> dict[str, float]:
        """Clipped value loss 0.5 max((V-R)^2, (V_clip-R)^2) against ``returns``, old ``values``.

        Each micro-batch moves to the model's device and its loss and statistics stay there:
        the step's statistics reach the host in one transfer at the end (``host_floats``), as
        the actor's do. Returns critic/vf_loss (the mean over optimizer steps of each step's
        loss; data parallel: this rank's partial, the worker group sums them), critic/grad_norm
        (the mean over optimizer steps of the global norm before clipping) and the
        token-weighted means of the loss's statistics over the whole batch."""
        a = self.algo
        self.model.train()
        dev = model_device(self.model)
        sums: dict[str, Any] = defaultdict(float)
        count: Any = 0.0
        n_mini = 0
        loss_total: Any = 0.0
        grad_total: Any = 0.0
        with deferred_stats():
            for _ in range(a.epochs):
                for mini in self._mini_batches(exp):
                    self.parallelism.plan_forwards(self.model, partial(self._count, mini))
                    norm = self._loss_norm(mini)
                    self.optimizer.zero_grad(set_to_none=True)
                    for _, micro in mini.micro_batches(a.micro_batch_size, a.micro_batch_tokens):
                        micro = micro.to(dev)
                        tokens = micro.response_mask.sum()  # on the device: no read
                        loss, stats = self._micro_step(micro, norm)
                        loss_total = loss_total + loss  # partial losses add up
                        for k, v in stats.items():
                            sums[k] = sums[k] + v * tokens
                        count = count + tokens
                    grad_total = grad_total + clip_and_step(
                        self.parallelism, self.model, self.optimizer, self.scheduler, self.grad_clip
                    )
                    n_mini += 1
        host = host_floats({**sums, _TOKENS: count, _LOSS: loss_total, _GRAD_NORM: grad_total})
        loss_mean = host.pop(_LOSS) / max(n_mini, 1)
        grad_norm = host.pop(_GRAD_NORM) / max(n_mini, 1)
        # data parallel: the token-weighted sums and the token count over ranks (the global
        # mean); vf_loss is this rank's partial loss, the worker group sums it
        total = self.parallelism.reduce_sums(host)
        count = total.pop(_TOKENS)
        out = {f"critic/{k}": v / max(count, 1e-12) for k, v in total.items()}
        out["critic/vf_loss"] = loss_mean
        out["critic/grad_norm"] = grad_norm
        return out

    def _micro_step(self, micro: Experience, norm: LossNorm) -> tuple[Tensor, dict[str, Any]]:
        """Forward, clipped value loss, backward on one micro-batch (on the model's device);
        the loss (detached) and the statistics as device tensors."""
        values = forward_values(self.model, micro.batch)
        assert micro.values is not None and micro.returns is not None
        loss, stats = clipped_value_loss(
            values,
            micro.values,
            micro.returns,
            micro.response_mask,
            norm,
            clip_range=self.algo.vf_clip,
        )
        (self.algo.vf_coef * loss).backward()
        return loss.detach(), stats

    def _mini_batches(self, exp: Experience) -> list[Experience]:
        """This epoch's mini-batches (a data-parallel rank: its part of the global ones)."""
        return self.parallelism.mini_batches(exp, self.algo.mini_batches, self.generator)

    def _loss_norm(self, mini: Experience) -> LossNorm:
        """The step-global normaliser (data parallel: the counts summed over ranks), the
        actor's: under ``seq-mean-token-sum-norm`` the value loss is
        sum(l*m) / (global_seqs * max_response_tokens), Dr.GRPO's constant (veRL's critic
        takes the actor's ``loss_agg_mode``, and divides by the response length there)."""
        empty = self.algo.seq_mean_empty_rows == "count"
        return self.parallelism.loss_norm(
            mini.response_mask, self.algo.loss_agg, self.max_response_tokens, empty
        )

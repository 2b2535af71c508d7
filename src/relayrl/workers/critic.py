"""Critic role: V(s_t) per response token and the clipped value-loss update."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from relayrl.algos import LossNorm, clipped_value_loss
from relayrl.config import AlgoConfig, OptimConfig, RunConfig
from relayrl.model import forward_values
from relayrl.workers.experience import Experience
from relayrl.workers.optim import TrainState, make_optimizer


class CriticWorker(TrainState):
    def __init__(self, model: torch.nn.Module, algo: AlgoConfig, optim: OptimConfig, seed: int = 0):
        self.model = model
        self.algo = algo
        self.grad_clip = optim.grad_clip
        self.optimizer, self.scheduler = make_optimizer(
            list(model.parameters()),
            optim.critic_lr,
            optim.weight_decay,
            optim.betas,
            optim.warmup_steps,
        )
        self.generator = torch.Generator().manual_seed(seed + 1)

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> CriticWorker:
        """The critic of a run: algorithm, optimizer and seed from ``cfg``."""
        return cls(model, cfg.algo, cfg.optim, cfg.seed)

    @torch.no_grad()
    def compute_values(self, exp: Experience) -> Tensor:
        self.model.eval()
        a = self.algo
        parts = [
            (idx, forward_values(self.model, mb.batch))
            for idx, mb in exp.micro_batches(a.micro_batch_size, a.micro_batch_tokens)
        ]
        return exp.scatter_tokens(parts) * exp.response_mask

    def update(self, exp: Experience) -> dict[str, float]:
        """Clipped value loss 0.5 max((V-R)^2, (V_clip-R)^2) against ``returns``, old ``values``."""
        a = self.algo
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        count = 0.0
        n_mini = 0
        total_loss = 0.0
        for _ in range(a.epochs):
            for mini in self._mini_batches(exp):
                norm = self._loss_norm(mini)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for _, micro in mini.micro_batches(a.micro_batch_size, a.micro_batch_tokens):
                    values = forward_values(self.model, micro.batch)
                    assert micro.values is not None and micro.returns is not None
                    loss, stats = clipped_value_loss(
                        values,
                        micro.values,
                        micro.returns,
                        micro.response_mask,
                        norm,
                        clip_range=a.vf_clip,
                    )
                    (a.vf_coef * loss).backward()
                    tokens = float(micro.response_mask.sum())
                    loss_sum += float(loss.detach())  # partial losses add up
                    for k, v in stats.items():
                        sums[k] += v * tokens
                    count += tokens
                self._reduce_gradients()
                max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                self.optimizer.step()
                self.scheduler.step()
                total_loss += loss_sum
                n_mini += 1
        out = {f"critic/{k}": v / max(count, 1e-12) for k, v in sums.items()}
        out["critic/vf_loss"] = total_loss / max(n_mini, 1)
        return out

    def _mini_batches(self, exp: Experience) -> list[Experience]:
        """This epoch's mini-batches (a data-parallel rank: its part of the global ones)."""
        return exp.shuffled_splits(self.algo.mini_batches, self.generator)

    def _loss_norm(self, mini: Experience) -> LossNorm:
        """The step-global normaliser (a data-parallel critic sums the counts over ranks)."""
        empty = self.algo.seq_mean_empty_rows == "count"
        return LossNorm.for_batch(mini.response_mask, self.algo.loss_agg, 1.0, empty)

    def _reduce_gradients(self) -> None:
        """Hook before clipping: a data-parallel critic all-reduces gradients here."""

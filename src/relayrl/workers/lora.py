"""LoRA as an option on the actor (``model.lora``): the actor whose ``state_dict`` is the merged
model, its data-parallel variant, and the reference that is the actor with adapters disabled.

Split from ``relayrl.workers.build`` so that ``build`` (which picks a worker class) and
``fsdp_lora`` (the FSDP2 LoRA workers, built on these) do not import each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from relayrl.config import RunConfig
from relayrl.model.lora import adapters_disabled, merged_state_dict
from relayrl.workers.actor import ActorWorker, ReferenceWorker
from relayrl.workers.data_parallel import DataParallelActorWorker
from relayrl.workers.experience import Experience


class LoraActorWorker(ActorWorker):
    """The actor of a LoRA run: adapters train; ``state_dict`` is the merged full model
    (the weights the rollout engine runs), under the base model's keys."""

    def state_dict(self) -> dict[str, Tensor]:
        return merged_state_dict(self.model)


def broadcast_trainable(model: torch.nn.Module) -> None:
    """Every trainable parameter (the LoRA adapters) set to rank 0's values: peft draws
    ``lora_A`` from each process's own RNG, so the ranks' adapters start different."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


class LoraDataParallelActorWorker(LoraActorWorker, DataParallelActorWorker):
    """A LoRA actor on one data-parallel rank: each rank holds the full frozen base and the
    adapters (replicas); only the adapters' gradients are all-reduced (SUM, over the global
    loss counts), so every rank takes the single-process step. The adapters start as rank
    0's (peft draws ``lora_A`` from each process's own RNG)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> ActorWorker:
        broadcast_trainable(model)
        return super().from_config(model, cfg)


class AdapterDisabledReference(ReferenceWorker):
    """The reference of a LoRA run: the actor's own model with its adapters disabled, so
    pi_ref is the base model without a second copy of its weights."""

    def __init__(self, actor: ActorWorker, cfg: RunConfig):
        # not ReferenceWorker.__init__: that would freeze (and eval) the actor's model
        self.model = actor.model
        self.micro_batch_size = cfg.algo.micro_batch_size
        self.micro_batch_tokens = cfg.algo.micro_batch_tokens
        self.temperature = cfg.rollout.temperature

    def compute_logprobs(self, exp: Experience) -> Tensor:
        with adapters_disabled(self.model):
            return super().compute_logprobs(exp)

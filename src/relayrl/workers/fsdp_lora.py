"""LoRA adapters on an FSDP2-sharded base (``model.lora`` with ``model.fsdp.enabled``).

``fully_shard`` takes the peft model as it is: every parameter, frozen base weight or trained
adapter, is sharded over the ranks; only the adapters have gradients, and FSDP2
reduce-scatters exactly those (SUM over ranks of losses normalised by the global counts: the
single-process gradient). The adapters start as rank 0's (peft draws ``lora_A`` from each
process's RNG): they are broadcast before sharding. The engine's weights are the merged ones,
gathered one tensor at a time and merged as each adapted layer's base weight, ``lora_A`` and
``lora_B`` arrive (``iter_full_tensors`` -> ``relayrl.model.lora.merged_stream``); the
checkpoint's peft adapter is gathered under the peft model's own keys (``adapter_state``).
The reference is the same sharded model with its adapters disabled, padded to the same
number of forwards on every rank as the actor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.config import RunConfig
from relayrl.workers.experience import Experience
from relayrl.workers.fsdp import FsdpActorWorker, _count_micro, full_state_dict
from relayrl.workers.lora import AdapterDisabledReference, broadcast_trainable


class FsdpLoraActorWorker(FsdpActorWorker):
    """An FSDP2 actor whose model is a peft LoRA model; ``state_dict``: the merged full
    weights on rank 0 (a collective)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: RunConfig) -> FsdpLoraActorWorker:
        broadcast_trainable(model)
        worker = super().from_config(model, cfg)
        assert isinstance(worker, FsdpLoraActorWorker)
        return worker

    def adapter_state(self) -> dict[str, Tensor]:
        """The peft model's full state dict (adapters included) on rank 0, ``{}`` elsewhere:
        what ``save_adapter`` writes. A collective."""
        return full_state_dict(self.model, self.sync_bucket_bytes, merged=False)


class FsdpAdapterDisabledReference(AdapterDisabledReference):
    """pi_ref of a sharded LoRA actor: its model with adapters disabled; every rank runs the
    same number of forwards (the actor's ``CollectivePadder``)."""

    def __init__(self, actor: FsdpLoraActorWorker, cfg: RunConfig):
        super().__init__(actor, cfg)
        self._padder = actor.padder

    def compute_logprobs(self, exp: Experience) -> Tensor:
        self._padder.plan(_count_micro(exp, self.micro_batch_size, self.micro_batch_tokens))
        out = super().compute_logprobs(exp)  # adapters disabled inside
        self._padder.pad(backward=False)  # dummy forwards: the same collectives either way
        return out

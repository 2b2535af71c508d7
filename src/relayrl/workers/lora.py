"""LoRA as an option on the actor (``model.lora``): ``LoraOption``.

Whatever the parallelism, a LoRA actor is the one ``ActorWorker`` whose model is a peft model
and whose ``lora`` is a ``LoraOption``: only the adapters train (peft's choice of trainable
parameters is kept), the ranks of a process group start from rank 0's adapters (peft draws
``lora_A`` from each process's own RNG: ``prepare`` broadcasts them, before an FSDP2 wrap),
``state_dict`` is the merged full model under the base model's keys (the weights the rollout
engine runs; ``Parallelism.full_state_dict`` with ``merged``), ``adapter_state`` the peft
model's own keys (the adapter checkpoint). The reference is the actor's own model with the
adapters disabled (``ReferenceWorker.adapters_disabled_of``): no second copy of the base.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.config import LoraConfig
from relayrl.model.lora import apply_lora
from relayrl.workers.parallel import Parallelism


def broadcast_trainable(model: torch.nn.Module) -> None:
    """Every trainable parameter (the LoRA adapters) set to rank 0's values: peft draws
    ``lora_A`` from each process's own RNG, so the ranks' adapters start different."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


def is_adapter_dir(path: str) -> bool:
    """Whether ``path`` is a peft adapter directory (a LoRA checkpoint)."""
    return (Path(path) / "adapter_config.json").is_file()


class LoraOption:
    """LoRA adapters on the actor's model; ``config`` None: they come with a checkpoint."""

    def __init__(self, config: LoraConfig | None = None):
        self.config = config

    def wrap(self, base: torch.nn.Module, adapter_dir: str | None = None) -> torch.nn.Module:
        """The adapter wrap: ``base`` with the peft adapters of ``adapter_dir`` (trainable), or
        with fresh ones per ``config`` (``relayrl.model.lora.apply_lora``)."""
        if adapter_dir is not None:
            from peft import PeftModel

            return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
        if self.config is None:
            raise ValueError("LoraOption.wrap: no model.lora config and no adapter directory")
        return apply_lora(base, self.config)  # type: ignore[no-any-return]

    def prepare(self, model: torch.nn.Module, parallelism: Parallelism) -> None:
        """Before the parallelism wraps the model: every rank starts from rank 0's adapters."""
        if parallelism.distributed:
            broadcast_trainable(model)

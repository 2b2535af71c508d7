"""LoRA adapters through ``peft`` (``model.lora``): wrap, disable for the reference, merge.

Only the adapters train (peft freezes the base weights). The reference policy is the same
model inside ``adapters_disabled``: no second copy of the base weights is loaded. The rollout
engine receives ``merged_state_dict`` (W + alpha/r * B @ A under the base model's own keys),
so it runs the plain HF architecture. Checkpoints hold the adapter in peft format
(``save_adapter``: ``adapter_config.json`` + ``adapter_model.safetensors``) and optionally a
merged HF export (``save_merged``) that loads with plain ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.config import LoraConfig


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """``model`` wrapped in a ``peft`` LoRA model: adapters on ``lora.target_modules``, every
    other weight frozen. A target name that matches no module is a one-line ``ValueError``."""
    import peft

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in names]
    if missing:
        raise ValueError(
            f"model.lora.target_modules: no module named {', '.join(missing)} in "
            f"{type(model).__name__} (linear layers: {', '.join(sorted(_linear_names(model)))})"
        )
    cfg = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, cfg)


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (has adapters)."""
    try:
        import peft
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, peft.PeftModel)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block (the reference policy); nothing for a plain model."""
    if is_lora(model):
        with model.disable_adapter():  # type: ignore[operator]
            yield
    else:
        yield


def merged_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The base model's state dict with every adapted weight replaced by W + delta (the
    adapter merged), under the base model's own keys; the model itself is not changed."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    d = module.get_delta_weight(adapter)
                    delta = d if delta is None else delta + d
            if delta is not None:
                deltas[f"{name}.weight"] = delta
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            if plain in deltas:
                value = value + deltas[plain].to(value.dtype)
            value = value.detach()
            out[plain] = value.to(dtype) if dtype is not None else value
    return out


def save_adapter(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """The adapter in peft format (``PeftModel.from_pretrained(base, out_dir)`` loads it)."""
    model.save_pretrained(str(out_dir))  # type: ignore[operator]
    return Path(out_dir)


def save_merged(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path) -> Path:
    """A plain HF model directory of base + merged adapter (``from_pretrained`` loads it)."""
    merged = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    merged.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())

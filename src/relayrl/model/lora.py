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
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

import torch
from torch import Tensor

from relayrl.config import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel


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
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft says int; alpha / r takes a float
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


def is_lora(model: torch.nn.Module) -> TypeGuard[PeftModel]:
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
        with model.disable_adapter():
            yield
    else:
        yield


class _DeltaLayer(Protocol):
    """A peft LoRA layer: ``LoraLayer``'s subclasses (``Linear``, ``Embedding``, the convs)
    define ``get_delta_weight``; the base class does not declare it."""

    def get_delta_weight(self, adapter: str) -> Tensor: ...


def merged_state_dict(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The base model's state dict with every adapted weight replaced by W + delta (the
    adapter merged), under the base model's own keys; the model itself is not changed.
    ``model``: a peft model (``apply_lora``)."""
    from peft.tuners.lora import LoraLayer

    base = cast("PeftModel", model).get_base_model()
    deltas: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    d = cast(_DeltaLayer, module).get_delta_weight(adapter)
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


def save_adapter(model: PeftModel, out_dir: str | Path) -> Path:
    """The adapter in peft format (``PeftModel.from_pretrained(base, out_dir)`` loads it)."""
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def save_merged(model: PeftModel, tokenizer: Any, out_dir: str | Path) -> Path:
    """A plain HF model directory of base + merged adapter (``from_pretrained`` loads it)."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


PEFT_PREFIX = "base_model.model."
"""What a peft model's ``state_dict`` keys start with (the base model's keys follow)."""


def lora_scalings(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """module name (peft-model key prefix) -> {active adapter: alpha / r scaling}."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, dict[str, float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if getattr(module, "fan_in_fan_out", False):
                raise ValueError(f"{name}: fan_in_fan_out LoRA layers are not supported")
            out[name] = {a: float(module.scaling[a]) for a in module.active_adapters}
    return out


def merged_stream(
    model: torch.nn.Module, tensors: Iterator[tuple[str, Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """``merged_state_dict`` of ``model`` as a stream: ``tensors`` are the peft model's
    ``state_dict`` entries as full tensors, in order (e.g. gathered one at a time from FSDP2
    shards); each adapted weight comes out as ``W + scaling * B @ A`` under the base model's
    key once its ``base_layer.weight``, ``lora_A`` and ``lora_B`` have all arrived (peft lists
    them consecutively), every other tensor as it arrives. Adapter tensors are not emitted.
    At most one adapted module's tensors are held at a time in a peft layout."""
    scalings = lora_scalings(model)
    pending: dict[str, dict[str, Tensor]] = {}  # module -> its base weight, A's and B's

    def plain(key: str) -> str:
        key = key.removeprefix(PEFT_PREFIX)
        return key.replace(".base_layer.", ".")

    def ready(module: str) -> bool:
        got = pending[module]
        need = ["base"] + [f"{p}.{a}" for a in scalings[module] for p in ("A", "B")]
        return all(k in got for k in need)

    def merge(module: str) -> tuple[str, Tensor]:
        got = pending.pop(module)
        w = got["base"]
        delta = None
        ct = torch.float64 if w.dtype == torch.float64 else torch.float32
        for a, s in scalings[module].items():
            d = (got[f"B.{a}"].to(ct) @ got[f"A.{a}"].to(ct)) * s
            delta = d if delta is None else delta + d
        merged = w if delta is None else (w + delta.to(w.dtype))
        return plain(f"{module}.base_layer.weight"), merged

    for key, t in tensors:
        module, kind = _lora_part(key, scalings)
        if module is None:
            if ".lora_" not in key:
                yield plain(key), t
            continue
        pending.setdefault(module, {})[kind] = t
        if ready(module):
            yield merge(module)
    for module in list(pending):
        if "base" in pending[module]:  # adapters inactive: the base weight as it is
            yield plain(f"{module}.base_layer.weight"), pending.pop(module)["base"]


def _lora_part(key: str, scalings: dict[str, dict[str, float]]) -> tuple[str | None, str]:
    """(module, part) of a peft key that takes part in a merge: ``base`` (the adapted layer's
    base weight), ``A.<adapter>`` / ``B.<adapter>``; (None, '') otherwise."""
    for marker, part in ((".base_layer.weight", "base"), (".lora_A.", "A"), (".lora_B.", "B")):
        if marker in key:
            module = key.split(marker)[0]
            if module not in scalings:
                return None, ""
            if part == "base":
                return module, part
            adapter = key.split(marker)[1].removesuffix(".weight")
            if adapter in scalings[module]:
                return module, f"{part}.{adapter}"
            return None, ""
    return None, ""


def merged_entries(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of ``merged_stream``'s output, from the model's own
    ``state_dict`` (a sharded DTensor's global shape: nothing is gathered)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for key, v in model.state_dict().items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        out[name] = (tuple(int(d) for d in v.shape), v.dtype)
    return out

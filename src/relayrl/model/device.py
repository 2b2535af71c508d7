"""Devices and precision of the roles' models (``model.device``, ``model.dtype``).

Precision policy (as the GPU peers train):

* ``float32`` / ``float64``: parameters, optimizer state and forwards in that dtype.
* ``bfloat16`` with ``model.mixed_precision`` (the default): a trainable role keeps fp32
  master weights, so AdamW's moments are fp32 too; its forwards run under
  ``torch.autocast(bfloat16)`` (FSDP2: ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` instead). A frozen role (reference, rollout engine) holds bf16 weights.
* ``bfloat16`` without ``mixed_precision``: everything in bf16 (the old behaviour).

Whatever the parameter dtype, logits are upcast to fp32 (kept in float64 under float64) before
logprobs, entropies and losses (``relayrl.model.batching``).

The compute dtype travels with the model (``set_compute_dtype``): every forward that goes
through ``forward_logprobs`` / ``forward_values`` enters ``compute_context(model)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from relayrl.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_AUTOCAST_ATTR = "_relayrl_autocast"
_M = TypeVar("_M", bound=torch.nn.Module)


class DeviceError(ValueError):
    """``model.device`` names a device this machine or torch build does not have."""


def resolve_device(spec: str, rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<rank % count>`` when CUDA is available, else ``cpu``; ``cuda`` on a
    machine without CUDA is a one-line ``DeviceError``."""
    if spec not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"model.device: unknown device {spec!r} (auto, cpu or cuda)")
    has_cuda = torch.cuda.is_available()
    if spec == "cpu" or (spec == "auto" and not has_cuda):
        return torch.device("cpu")
    if not has_cuda:
        raise DeviceError(
            f"model.device=cuda but CUDA is not available (torch {torch.__version__}); "
            "use model.device=cpu or auto"
        )
    return torch.device("cuda", rank % torch.cuda.device_count())


def local_cuda_index(
    rank: int, count: int, assigned: Sequence[str | int] = (), visible: str | None = None
) -> int:
    """The CUDA device index (``cuda:<index>``) a process of data-parallel ``rank`` computes on,
    among the ``count`` devices it sees.

    ``assigned``: the GPU ids Ray gave this process (``ray.get_gpu_ids()``; empty outside Ray
    or in a pool without GPUs); ``visible``: its ``CUDA_VISIBLE_DEVICES`` (None: unset).
    With an assignment the index is the first assigned id's position in ``visible``: Ray sets
    ``visible`` to the assigned ids, so that is 0; under
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` every GPU of the node stays visible and the
    position is the id's own (unset: the id itself). Without one: ``rank % count``, the
    convention of one process per local GPU in rank order. A ``DeviceError`` when the
    assigned GPU is not among the visible ones."""
    if count < 1:
        raise DeviceError("no CUDA device visible to this process")
    if not assigned:
        return rank % count
    first = str(assigned[0]).strip()
    ids = [v.strip() for v in visible.split(",")] if visible is not None else None
    if ids is not None and first in ids:
        index = ids.index(first)
    elif ids is None and first.isdigit():
        index = int(first)
    else:
        raise DeviceError(
            f"Ray assigned GPU {first} to this process but CUDA_VISIBLE_DEVICES={visible!r} "
            "does not list it"
        )
    if index >= count:
        raise DeviceError(
            f"Ray assigned GPU {first} (local index {index}) but this process sees {count} "
            "CUDA device(s)"
        )
    return index


@dataclass(frozen=True)
class Precision:
    """Dtypes of one role: what its parameters are stored in, what its forwards compute in."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """Parameters wider than the compute dtype (fp32 master weights under bf16 compute)."""
        return self.param_dtype != self.compute_dtype


def precision_for(model_cfg: ModelConfig, trainable: bool) -> Precision:
    """The precision of a trainable (actor, critic) or frozen (reference, engine) role."""
    compute = DTYPES[model_cfg.dtype]
    if compute == torch.bfloat16 and model_cfg.mixed_precision and trainable:
        return Precision(torch.float32, torch.bfloat16)
    return Precision(compute, compute)


_DEVICE_ATTR = "_relayrl_device"


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: the device ``apply_precision`` put it on (FSDP2 with CPU
    offload keeps its shards on the CPU but computes there), else its first parameter's."""
    dev = getattr(model, _DEVICE_ATTR, None)
    if dev is not None:
        return dev
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def set_compute_dtype(
    model: _M, dtype: torch.dtype | None, device: torch.device | None = None
) -> _M:
    """Run the model's ``forward_logprobs`` / ``forward_values`` under autocast to ``dtype``
    (None: no autocast). Only needed where the parameters are wider than ``dtype``."""
    if dtype is None:
        setattr(model, _AUTOCAST_ATTR, None)
    else:
        dev = device if device is not None else model_device(model)
        setattr(model, _AUTOCAST_ATTR, (dev.type, dtype))
    return model


@contextlib.contextmanager
def compute_context(model: torch.nn.Module) -> Iterator[None]:
    """Autocast to the compute dtype set by ``set_compute_dtype``; nothing when none is set."""
    spec = getattr(model, _AUTOCAST_ATTR, None)
    if spec is None:
        yield
        return
    with torch.autocast(device_type=spec[0], dtype=spec[1]):
        yield


def apply_precision(model: _M, precision: Precision, device: torch.device) -> _M:
    """Move ``model`` to ``device`` in ``precision.param_dtype``; autocast when mixed."""
    model = model.to(device=device, dtype=precision.param_dtype)
    setattr(model, _DEVICE_ATTR, device)
    return set_compute_dtype(model, precision.compute_dtype if precision.mixed else None, device)


def enable_gradient_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """HF activation checkpointing of every decoder layer, non-reentrant (works with frozen
    inputs, LoRA and FSDP2); active in train mode only, so no-grad forwards are unchanged."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"model.gradient_checkpointing: {type(model).__name__} does not support it "
            "(no gradient_checkpointing_enable)"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model

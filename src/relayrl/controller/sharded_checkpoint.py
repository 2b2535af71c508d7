"""Sharded checkpoints of FSDP2 roles (``torch.distributed.checkpoint``) for exact resume.

Layout: ``<dir>/`` holds one DCP checkpoint (each rank writes its own shards of every role's
parameters and optimizer state, plus ``.metadata``) and ``rank_<r>.pt`` per rank with what
is not sharded: the LR scheduler and the shuffling generator of each role. Loading reshards to
the ranks that load (same world size for an exact resume). All ranks must call both functions.

The HF-format ``actor/`` export next to it stays a plain ``save_pretrained`` directory: it is
written from the full state dict gathered bucket by bucket (``export_full``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _sharded_state(roles: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "model": get_model_state_dict(w.model),
            "optim": get_optimizer_state_dict(w.model, w.optimizer),
        }
        for name, w in roles.items()
    }


def save_sharded(out_dir: str | Path, roles: Mapping[str, Any]) -> Path:
    """Save ``roles`` (name -> trainable worker with ``model``, ``optimizer``, ``scheduler``,
    ``generator``) as a sharded checkpoint in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(roles), checkpoint_id=str(out))
    extra = {
        name: {"scheduler": w.scheduler.state_dict(), "generator": w.generator.get_state()}
        for name, w in roles.items()
    }
    torch.save(extra, out / f"rank_{_rank()}.pt")
    if dist.is_initialized():
        dist.barrier()
    return out


def load_sharded(in_dir: str | Path, roles: Mapping[str, Any]) -> None:
    """Load a ``save_sharded`` checkpoint into freshly built ``roles`` (same names)."""
    src = Path(in_dir)
    if not (src / ".metadata").is_file():
        raise FileNotFoundError(f"{src}: not a sharded checkpoint (no .metadata)")
    state = _sharded_state(roles)
    dcp.load(state, checkpoint_id=str(src))
    extra = torch.load(src / f"rank_{_rank()}.pt", weights_only=False)
    for name, w in roles.items():
        set_model_state_dict(w.model, state[name]["model"])
        set_optimizer_state_dict(w.model, w.optimizer, state[name]["optim"])
        w.scheduler.load_state_dict(extra[name]["scheduler"])
        w.generator.set_state(extra[name]["generator"])


def export_full(
    model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, load_path: str
) -> None:
    """A plain HF directory of the sharded ``model`` (rank 0 writes; every rank must call):
    the architecture from ``load_path``, weights gathered bucket by bucket."""
    from relayrl.model import load_causal_lm, save_model_atomic
    from relayrl.workers.fsdp import full_state_dict

    state = full_state_dict(model, 256 << 20)
    if _rank() == 0:
        plain = load_causal_lm(load_path)
        plain.load_state_dict(state)
        save_model_atomic(plain, tokenizer, out_dir)
    if dist.is_initialized():
        dist.barrier()

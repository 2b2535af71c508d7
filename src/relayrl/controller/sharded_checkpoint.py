"""Sharded checkpoints of FSDP2 roles (``torch.distributed.checkpoint``) for exact resume.

Layout: ``<dir>/`` holds one DCP checkpoint (each rank writes its own shards of every role's
parameters and optimizer state, plus ``.metadata``) and ``rank_<r>.pt`` per rank with what
is not sharded: the LR scheduler and the shuffling generator of each role. Loading reshards to
the ranks that load, at any world size (a rank without its own ``rank_<r>.pt`` takes rank 0's:
that state is the same on every rank). All ranks must call both functions. A write that fails
on one rank (disk full, I/O error) raises the same one-line ``ShardedWriteError`` (an
``OSError``) on every rank, after every rank has finished its part: no rank is left waiting
in a collective.

The HF-format ``actor/`` export next to it stays a plain ``save_pretrained`` directory: it is
written from the full state dict gathered bucket by bucket (``export_full``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.workers.fsdp import agree, load_sharded, save_sharded

__all__ = ["export_full", "load_sharded", "save_sharded"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def export_full(
    model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, load_path: str
) -> None:
    """A plain HF directory of the sharded ``model`` (rank 0 writes; every rank must call):
    the architecture from ``load_path``, weights gathered bucket by bucket."""
    from relayrl.model import load_causal_lm, save_model_atomic
    from relayrl.workers.fsdp import full_state_dict

    state = full_state_dict(model, 256 << 20)

    def write() -> None:
        if _rank() == 0:
            plain = load_causal_lm(load_path)
            plain.load_state_dict(state)
            save_model_atomic(plain, tokenizer, out_dir)

    agree(Path(out_dir), write)  # rank 0's failure raised on every rank (no one left waiting)

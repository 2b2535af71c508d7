"""The rank processes of tests/integration/test_fsdp_checkpoint_faults.py: a sharded checkpoint
written, then three writes that fail on rank 1 only (its folder, a DCP shard file, its
``rank_1.pt``); each rank records what it raised, one line a fault, in ``outcome_<rank>.txt``.
The process group times out after ``TIMEOUT_S``: a rank left waiting in a collective records
that timeout instead of the fault."""

from __future__ import annotations

import errno
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

TIMEOUT_S = 30
FAULTS = ("mkdir", "shard", "rank_file")


def _fail_on_rank_1(fault: str, rank: int) -> Any:
    """Install ``fault`` (rank 1 only); return the undo."""
    if rank != 1:
        return lambda: None
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fault == "mkdir":
        real_mkdir = Path.mkdir

        def mkdir(self: Path, *a: Any, **k: Any) -> None:
            raise err

        Path.mkdir = mkdir  # type: ignore[method-assign]
        return lambda: setattr(Path, "mkdir", real_mkdir)
    if fault == "shard":  # DCP's file writer syncs each shard file it wrote
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            raise err

        os.fsync = fsync
        return lambda: setattr(os, "fsync", real_fsync)
    real_save = torch.save

    def save(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        if Path(str(f)).name.startswith("rank_"):
            raise err
        real_save(obj, f, *a, **k)

    torch.save = save
    return lambda: setattr(torch, "save", real_save)


def rank_main(rank: int, world: int, init_file: str, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from fsdp_ranks import train_actor
    from relayrl.workers.fsdp import save_sharded

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    out = Path(out_dir)
    actor, _ = train_actor(Path(model_dir), rank, world)
    save_sharded(out / "good", {"actor": actor})
    lines = []
    for fault in FAULTS:
        undo = _fail_on_rank_1(fault, rank)
        try:
            save_sharded(out / f"bad_{fault}", {"actor": actor})
            lines.append(f"{fault}: no error")
        except BaseException as exc:  # noqa: BLE001 - the test reads what was raised
            lines.append(f"{fault}: {type(exc).__name__}: {exc}".replace("\n", " | "))
        finally:
            undo()
    (out / f"outcome_{rank}.txt").write_text("\n".join(lines) + "\n")
    sys.stdout.flush()
    os._exit(0)

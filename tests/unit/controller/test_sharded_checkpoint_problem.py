"""``checkpoint_problem`` checks an FSDP2 role's sharded checkpoint (``sharded_<role>/``, a
``torch.distributed.checkpoint`` folder) without reading a tensor: a shard file lost or cut
short, a garbled ``.metadata``, a lost or corrupt ``rank_<r>.pt`` is named in one line relative
to the checkpoint, and ``intact_checkpoint`` (what a resume takes) passes over that checkpoint
for the one before. The checkpoints are real: ``save_checkpoint`` with the project's
``save_sharded`` writer, in one process without a process group (DCP saves as one rank)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from relayrl.controller.checkpoint import (
    STATE_FILE,
    checkpoint_problem,
    intact_checkpoint,
    role_state,
    save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Saver:
    def save_pretrained(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


class _ShardedRole:
    """What ``save_sharded`` takes of an FSDP2 role (model, optimizer with state, scheduler,
    generator), on a plain module: DCP writes it as rank 0 of one."""

    sharded = True

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.Adam(self.model.parameters())
        self.model(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.generator = torch.Generator().manual_seed(1)

    def save_sharded(self, out_dir: str) -> None:
        from relayrl.workers.fsdp import save_sharded

        save_sharded(out_dir, {"actor": self})


def _save(run: Path, step: int) -> Path:
    """Checkpoint ``step`` of a run whose actor is sharded; its write time ``step`` seconds."""
    entry, writer = role_state(_ShardedRole(), "actor")
    assert writer is not None
    final = save_checkpoint(
        run, step, {"actor": _Saver()}, _Saver(), {"actor": entry}, keep=5, writers=[writer]
    )
    os.utime(final / STATE_FILE, ns=(step * 10**9, step * 10**9))
    return final


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return _save(tmp_path, 1)


def _shard(ckpt: Path) -> tuple[str, int]:
    """The shard file ``.metadata`` names, and the bytes its items span (offset + length)."""
    reader = FileSystemReader(str(ckpt / "sharded_actor"))
    storage: dict[Any, Any] = reader.read_metadata().storage_data
    (rel,) = {info.relative_path for info in storage.values()}
    return rel, max(info.offset + info.length for info in storage.values())


def test_an_intact_sharded_checkpoint_has_no_problem(ckpt):
    sharded = ckpt / "sharded_actor"
    assert sorted(p.name for p in sharded.iterdir()) == [".metadata", "__0_0.distcp", "rank_0.pt"]
    rel, end = _shard(ckpt)
    assert (sharded / rel).stat().st_size == end  # the last item ends the file
    assert checkpoint_problem(ckpt) is None


def test_a_lost_shard_file_is_named(ckpt):
    (ckpt / "sharded_actor/__0_0.distcp").unlink()
    assert checkpoint_problem(ckpt) == "sharded_actor/__0_0.distcp is missing (.metadata names it)"


def test_a_shard_file_one_byte_short_is_named(ckpt):
    rel, end = _shard(ckpt)
    os.truncate(ckpt / "sharded_actor" / rel, end - 1)
    assert checkpoint_problem(ckpt) == (
        f"sharded_actor/{rel} is truncated ({end - 1} bytes, .metadata needs {end})"
    )


def test_an_empty_shard_file_is_named(ckpt):
    rel, end = _shard(ckpt)
    os.truncate(ckpt / "sharded_actor" / rel, 0)
    want = f"sharded_actor/{rel} is truncated (0 bytes, .metadata needs {end})"
    assert checkpoint_problem(ckpt) == want


@pytest.mark.parametrize("damage", ["garbled", "cut", "lost"])
def test_a_garbled_cut_or_lost_metadata_is_named(ckpt, damage):
    meta = ckpt / "sharded_actor/.metadata"
    if damage == "garbled":
        meta.write_bytes(b"\x00not a pickle" * 8)
    elif damage == "cut":
        os.truncate(meta, meta.stat().st_size // 2)
    else:
        meta.unlink()
    problem = checkpoint_problem(ckpt)
    assert problem is not None and problem.startswith("sharded_actor/.metadata cannot be read: ")
    assert "\n" not in problem and str(ckpt) not in problem


def test_a_metadata_without_storage_data_is_named(ckpt):
    meta = ckpt / "sharded_actor/.metadata"
    metadata = pickle.loads(meta.read_bytes())
    metadata.storage_data = None
    meta.write_bytes(pickle.dumps(metadata))
    assert checkpoint_problem(ckpt) == "sharded_actor/.metadata names no shard files"


def test_a_lost_rank_0_pt_is_named(ckpt):
    (ckpt / "sharded_actor/rank_0.pt").unlink()
    want = "sharded_actor/rank_0.pt is missing (the scheduler and generator states)"
    assert checkpoint_problem(ckpt) == want


def test_a_cut_rank_pt_is_named(ckpt):
    sharded = ckpt / "sharded_actor"
    (sharded / "rank_1.pt").write_bytes((sharded / "rank_0.pt").read_bytes()[:100])
    problem = checkpoint_problem(ckpt)
    assert problem is not None and problem.startswith("sharded_actor/rank_1.pt cannot be read: ")


def test_resume_passes_over_a_checkpoint_with_a_cut_shard_for_the_one_before(tmp_path):
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    assert intact_checkpoint(tmp_path) == (newer, [])
    rel, end = _shard(newer)
    os.truncate(newer / "sharded_actor" / rel, end // 2)
    why = f"sharded_actor/{rel} is truncated ({end // 2} bytes, .metadata needs {end})"
    assert intact_checkpoint(tmp_path) == (older, [(newer, why)])
    (older / "sharded_actor" / rel).unlink()
    lost = f"sharded_actor/{rel} is missing (.metadata names it)"
    assert intact_checkpoint(tmp_path) == (None, [(newer, why), (older, lost)])

"""A sharded (FSDP2) checkpoint write that fails on one rank of two (its folder, a shard file
DCP writes, its ``rank_1.pt``; disk full) raises the same one-line ``ShardedWriteError`` on
both ranks, at once: no rank is left waiting in a collective (the group's timeout here is
30 s; torch's default is 30 minutes). The checkpoint written before stays intact and loads.
The resume's check of a sharded checkpoint passes the intact one and names a shard file cut
short. The kill-and-resume of an FSDP2 run is tests/integration/test_fsdp_crash_resume.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from fsdp_fault_ranks import FAULTS, rank_main
from relayrl.controller.checkpoint import sharded_problem
from relayrl.model import build_tiny_model


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_faults")
    model = build_tiny_model(root / "m", hidden_size=16)
    mp.spawn(rank_main, args=(2, str(root / "rendezvous"), str(model), str(root)), nprocs=2)
    return root, [(root / f"outcome_{r}.txt").read_text().splitlines() for r in (0, 1)]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_write_error_on_one_rank_is_one_line_on_every_rank(outcomes, fault):
    _, (rank0, rank1) = outcomes
    want = (
        f"{fault}: ShardedWriteError: [Errno 28] rank 1 could not write its part of "
        f"bad_{fault}: No space left on device"
    )
    assert [line for line in rank0 if line.startswith(f"{fault}:")] == [want]
    assert [line for line in rank1 if line.startswith(f"{fault}:")] == [want]


def test_the_checkpoint_before_the_failed_write_is_intact(outcomes):
    root, _ = outcomes
    good = root / "good"
    assert sorted(p.name for p in good.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    assert (good / ".metadata").is_file()
    extra = torch.load(good / "rank_1.pt", weights_only=False)
    assert set(extra["actor"]) == {"scheduler", "generator"}


def test_a_shard_of_a_two_rank_checkpoint_cut_short_is_named(outcomes, tmp_path):
    """The resume's check (``checkpoint_problem``'s :func:`sharded_problem`) on the real 2-rank
    checkpoint: intact, it passes; rank 1's shard file one byte short, it is named."""
    root, _ = outcomes
    assert sharded_problem(root, "good") is None
    cut = tmp_path / "cut"
    shutil.copytree(root / "good", cut)
    shard = cut / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size - 1)
    want = f"cut/__1_0.distcp is truncated ({size - 1} bytes, .metadata needs {size})"
    assert sharded_problem(tmp_path, "cut") == want

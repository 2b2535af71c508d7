"""A sharded (FSDP2) checkpoint write that fails on one rank of two (its folder, a shard file
DCP writes, its ``rank_1.pt``; disk full) raises the same one-line ``ShardedWriteError`` on
both ranks, at once: no rank is left waiting in a collective (the group's timeout here is
30 s; torch's default is 30 minutes). The checkpoint written before stays intact and loads.
The resume's check of a sharded checkpoint passes the intact one and names a shard file cut
short. The kill-and-resume of an FSDP2 run is tests/integration/test_fsdp_crash_resume.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fsdp_fault_ranks import FAULTS, rank_main
from relayrl.controller.checkpoint import checkpoint_problem, sharded_problem
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


@pytest.mark.slow
def test_a_resume_passes_over_a_checkpoint_with_a_cut_shard_for_the_one_before(tmp_path):
    """``relayrl train`` with an FSDP2 actor on 2 Ray ranks, 2 steps; rank 1's shard of the
    step-2 checkpoint cut to half: ``--resume`` for 3 steps keeps that checkpoint as
    ``corrupt_step_000002`` with a line naming the shard and trains steps 2 and 3 from the
    step-1 checkpoint (unchecked, the resume took step 2 and failed in DCP's load of the
    cut shard, a Ray traceback). Slow: two Ray runs, about a minute on 2 cores."""
    pytest.importorskip("ray")
    from tiny_runs import train_argv, write_config

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root.parent / "src"), str(root / "support")]),
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    fsdp = (
        "cluster=ray",
        "model.fsdp.enabled=true",
        "ray.pools={main: {bundles: 2, cpus_per_bundle: 0.5}}",
        "algo.mini_batches=1",
        "train.save_every=1",
    )
    tiny = build_tiny_model(tmp_path / "m", hidden_size=16)
    run = tmp_path / "run"
    config = write_config(tmp_path / "r.yaml", tiny, run)

    def train(steps: int, *flags: str) -> str:
        argv = train_argv(config, *fsdp, f"train.steps={steps}", flags=flags)
        argv = [sys.executable, "-m", "relayrl.cli", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout

    train(2)
    ckpt = run / "checkpoints/step_000002"
    shard = ckpt / "sharded_actor/__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    problem = checkpoint_problem(ckpt)
    assert problem is not None
    assert problem.startswith("sharded_actor/__1_0.distcp is truncated (")
    out = train(3, "--resume")
    assert (
        f"checkpoint {ckpt} cannot be read ({problem}); kept as corrupt_step_000002, resuming "
        f"from the newest intact checkpoint {run}/checkpoints/step_000001" in out
    )
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in out
    assert checkpoint_problem(ckpt) is None  # step 2 trained and written again
    assert checkpoint_problem(run / "checkpoints/step_000003") is None
    assert (run / "checkpoints/corrupt_step_000002/sharded_actor/__1_0.distcp").is_file()

"""SIGKILL in the middle of a whole-directory save (``relayrl.model.atomic_dir``, the save of
``relayrl sft``'s model), after the old directory was renamed away and before the new one was
renamed in, for the other two writers of it: ``relayrl rm``'s output model and the tinker
service's checkpoints. The next writer (``relayrl rm`` before it does anything that can fail,
the tinker service's checkpoint store when it starts) puts the killed save's model in place,
whole, and leaves no sibling directory behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from crash_points import kill_at
from relayrl.cli import main
from relayrl.controller.run_dir import claim_output_dir
from relayrl.model import build_tiny_model
from relayrl.tinker.checkpoints import CheckpointPath, CheckpointStore


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=16)


def _rm_config(tmp: Path, tiny: Path, out: Path, *extra: str) -> list[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    pairs = tmp / "pairs.jsonl"
    rows = [
        {"prompt": f"q{i}", "chosen": "good" * (i % 3 + 1), "rejected": "bad"} for i in range(8)
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp / "rm.yaml"
    cfg.write_text(
        f"model_path: {tiny}\noutput_dir: {out}\ntrain_path: {pairs}\nthreads: 1\n"
        "batch_size: 4\nmicro_batch_size: 4\neval_fraction: 0.25\n"
    )
    return ["rm", str(cfg), *extra]


def _siblings(out: Path) -> list[str]:
    skip = (out.name, f".{out.name}.lock")  # the output_dir lock stays, as sft's does
    return sorted(p.name for p in out.parent.iterdir() if p.name not in skip and "rm" in p.name)


def test_relayrl_rm_killed_in_its_save_has_the_new_model_put_in_place(tiny, tmp_path, capsys):
    straight = tmp_path / "straight" / "rm"
    assert main(_rm_config(tmp_path / "s", tiny, straight, "steps=2")) in (0, None)
    out = tmp_path / "killed" / "rm"
    assert main(_rm_config(tmp_path / "k", tiny, out, "steps=1")) in (0, None)  # the old model
    kill_at("sft_old", 1, _rm_config(tmp_path / "k", tiny, out, "steps=2"), tmp_path)
    assert not out.exists()  # killed between the two renames
    # the next `relayrl rm` completes that save first, even when it then fails
    missing = f"train_path={tmp_path}/missing.jsonl"
    assert main(_rm_config(tmp_path / "k", tiny, out, "steps=2", missing)) != 0
    assert "missing.jsonl: file not found" in capsys.readouterr().err
    assert _siblings(out) == []
    a, b = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "relayrl_rm.json").read_text())["steps"] == 2
    # its curves came with it: written into the new directory before the swap (they were
    # written after it, into the model directory, so a kill in the swap lost them)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]  # the two training steps, then the held-out figures


def test_relayrl_rm_on_an_output_directory_in_use_is_refused(tiny, tmp_path, capsys):
    """``relayrl rm`` locks its ``output_dir`` as ``relayrl sft`` does (it took no lock: two
    runs wrote one directory): refused in one line naming the holder, nothing written."""
    out = tmp_path / "rm"
    with claim_output_dir(out):  # held as a running `relayrl sft` holds it
        assert main(_rm_config(tmp_path, tiny, out, "steps=1")) != 0
    err = capsys.readouterr().err
    assert f"output directory {out} is in use by another relayrl run (pid {os.getpid()})" in err
    assert not out.exists()
    assert main(_rm_config(tmp_path, tiny, out, "steps=1")) in (0, None)  # released: goes ahead
    assert (out / "metrics.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if "rm" in p.name) == [
        ".rm.lock",
        "rm",
        "rm.yaml",
    ]


def test_a_tinker_checkpoint_killed_in_its_save_is_in_place_when_the_service_starts(tmp_path):
    root = tmp_path / "state"
    path = CheckpointPath("m", "weights", "w")
    assert main_store(root, "old") == 0
    kill_at("sft_old", 1, ["tinker-store", str(root), "new"], tmp_path)
    assert not (root / "m/weights/w").exists()  # killed between the two renames
    store = CheckpointStore(root)  # what the service does when it starts
    d, meta = store.read(path)
    assert meta["tag"] == "new" and (d / "trainable.safetensors").read_text() == "new"
    assert sorted(p.name for p in d.parent.iterdir()) == ["w"]
    assert [c["tinker_path"] for c in store.list("m")] == [path.uri]


def main_store(root: Path, tag: str) -> int:
    from crash_points import tinker_store

    return tinker_store(str(root), tag)


def test_a_checkpoint_a_killed_delete_renamed_aside_is_removed_on_start(tmp_path):
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(done.stdout)
    base = tmp_path / "state/m/weights"
    for pid in (dead, os.getpid()):  # a dead deleter's leftover, and a live one's
        (base / f".deleted_w_{pid}_0123abcd").mkdir(parents=True)
    store = CheckpointStore(tmp_path / "state")
    assert store.recovered == [f"removed .deleted_w_{dead}_0123abcd, left by an interrupted delete"]
    assert [p.name for p in base.iterdir()] == [f".deleted_w_{os.getpid()}_0123abcd"]

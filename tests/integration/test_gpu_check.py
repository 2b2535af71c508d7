"""`make gpu-check` on the CPU (slow set): the GPU check's GRPO steps with bf16 + FSDP2 + the own
engine run here through the same code, and print one JSON line with the agreed figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_check_runs_on_cpu(world):
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu"]
    cmd += ["--hidden", "64", "--layers", "2", "--steps", "2", "--world", str(world)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] and res["world"] == world and res["device"] == "cpu"
    assert res["engine_device"] == "cpu"  # rank 0's device: the model's
    assert res["logprob_abs_diff_mean"] <= res["tol_mean"]
    for key in ("gen_tokens_per_s", "train_tokens_per_s", "weight_sync_s"):
        assert res[key] > 0, key

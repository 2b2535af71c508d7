"""The tinker-cookbook's arithmetic RL recipe (``python -m
tinker_cookbook.recipes.math_rl.train``), unmodified, against ``relayrl tinker-serve``, through
``bench/peer_cookbook.py`` in the cookbook's own venv (``.bench-venv/cookbook``: made from
``bench/peer_cookbook.lock`` with ``pip install --no-deps`` on first use, reused while its
stamp matches the lock; building it needs the package registry once).

The default-suite test runs the recipe for 2 steps on a tiny untrained model to completion;
the slow one is the bench's default run (warm start to 25% correct, 20 recipe steps at lr 1e-4) and
checks that the recipe's reward rises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import load_bench

BENCH = Path(__file__).resolve().parents[2] / "bench" / "peer_cookbook.py"


def _run(tmp_path: Path, *args: str, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bench in the cookbook venv (made or reused first); its recipe and summary lines."""
    py = load_bench("peer_cookbook").setup(Path(sys.executable))
    cmd = [str(py), str(BENCH), "--out", str(tmp_path / "out"), "--arms", "recipe", *args]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **env})  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    (recipe,) = [x for x in lines if "recipe" in x]
    (summary,) = [x for x in lines if x.get("summary") == "peer_cookbook"]
    assert "Training completed successfully" in r.stderr
    return recipe, summary


def test_lock_stamp_and_curve_summary(tmp_path: Path) -> None:
    bench = load_bench("peer_cookbook")
    lock = tmp_path / "x.lock"
    lock.write_text("foo==1\n")
    venv = tmp_path / "v"
    assert not bench.venv_ready(venv, lock)
    venv.mkdir()
    (venv / ".installed").write_text(bench._digest(lock) + "\n")
    assert bench.venv_ready(venv, lock)
    lock.write_text("foo==2\n")  # a changed lock rebuilds the venv
    assert not bench.venv_ready(venv, lock)
    s = bench.curve_summary([0.1, 0.2, 0.3, 0.3, 0.5, 0.4], 2)
    assert s == {"k": 2, "correct_first": 0.15, "correct_last": 0.45, "rise": 0.3}
    assert bench.curve_summary([0.1, 0.3], 5)["k"] == 1
    a = bench.parse(["--sft-steps", "100", "--sft-warmup", "10", "--sft-lr", "1e-3"])
    lrs = [bench.sft_lr(i, a) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[50] == pytest.approx(1e-4 + 0.9e-3 * 0.5) and min(lrs[10:]) > 1e-4


def test_recipe_runs_unmodified_to_completion(tmp_path: Path) -> None:
    """Two steps of the recipe (2 groups of 2) on a tiny model warmed up for 2 SFT steps: the
    recipe's own metrics come back, and its sampler-vs-trainer KL is at fp32 noise."""
    recipe, summary = _run(
        tmp_path, "--hidden", "32", "--sft-steps", "2", "--sft-batch", "4",
        "--sft-eval-every", "2", "--sft-eval-size", "2", "--sft-target", "0",
        "--steps", "2", "--groups", "2", "--group", "2", timeout=600,
    )  # fmt: skip
    assert recipe["steps"] == 2 and len(recipe["correct"]) == 2
    assert all(0.0 <= c <= 1.0 for c in recipe["correct"])
    assert recipe["kl_sample_train_max"] < 1e-4
    assert summary["warm_up_steps"] == 2 and set(summary["warm_up_correct"]) == {"2"}


@pytest.mark.slow
def test_recipe_reward_rises(tmp_path: Path) -> None:
    """The bench's default run (seed 0): warm start through the SDK until 25% of held-out
    samples are correct, then 20 recipe steps; the mean ``env/all/correct`` of the last 5
    steps is above that of the first 5."""
    recipe, summary = _run(tmp_path, timeout=3600)
    assert max(summary["warm_up_correct"].values()) >= 0.25
    assert recipe["steps"] == 20 and recipe["kl_sample_train_max"] < 1e-4
    assert summary["rise"] > 0.03, summary  # measured 0.08-0.13 (docs/tinker.md)

"""``relayrl report`` on real run directories: two short GRPO runs side by side (default
suite) and two async runs side by side (slow)."""

from __future__ import annotations

import math
import re
import struct
import sys
from pathlib import Path

import pytest

from helpers import run_config
from relayrl.cli import main
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.model import build_tiny_model
from relayrl.telemetry import read_metrics

pytest.importorskip("matplotlib")

TINY = [
    "algo.prompts_per_step=2",
    "algo.group_size=2",
    "rollout.max_tokens=4",
    "data.eval_size=2",
    "train.eval_every=2",
]
CORE_PNGS = [
    "reward.png",
    "pass_rate.png",
    "kl.png",
    "entropy.png",
    "response_length.png",
    "clip_fraction.png",
    "time_split.png",
    "timeline.png",
]


def _run(model: Path, run_dir: Path, *overrides: str) -> Path:
    cfg = run_config(model, run_dir, *TINY, *overrides)
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    return run_dir


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def _check_report(out: Path, runs: list[Path], pngs: list[str]) -> str:
    text = (out / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert set(pngs) <= set(linked)
    for name in linked:
        w, h = _png_size(out / name)
        assert w >= 800 and h >= 350, (name, w, h)  # readable at 120 dpi
    for run in runs:
        assert f"| {run.name} |" in text
        # the summary's last reward and step time are the run's own last values
        last = [r for r in read_metrics(run) if "reward_mean" in r][-1]
        row = next(line for line in text.splitlines() if line.startswith("| step time (s)"))
        assert format(last["time/step"], ".3g") in row
    return text


def test_report_two_runs_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_tiny_model(tmp_path / "m", hidden_size=16, seed=0)
    a = _run(model, tmp_path / "kl0", "train.steps=4", "algo.kl_coef=0")
    b = _run(model, tmp_path / "kl1", "train.steps=3", "algo.kl_coef=0.1", "eval.n=2")
    evals = [r for r in read_metrics(b) if "eval/pass_rate" in r]  # the same eval code
    assert [r["step"] for r in evals] == [0, 2, 3] and all("eval/maj@2" in r for r in evals)
    out = tmp_path / "report"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    text = _check_report(out, [a, b], CORE_PNGS)
    assert f"| kl0 | `{a}` | grpo | sync | 4 |" in text
    assert f"| kl1 | `{b}` | grpo | sync | 3 |" in text
    # time split: the table's mean train seconds per step are the runs' own
    row = next(line for line in text.splitlines() if line.startswith("| kl1 | 0."))
    train_s = [r["time/train"] for r in read_metrics(b) if "time/train" in r]
    assert f"{math.fsum(train_s) / len(train_s):.3f}" in row.split("|")[4]
    # one run: the default output directory is RUN_DIR/report
    assert main(["report", str(a)]) == 0
    assert (a / "report" / "report.md").exists()


def test_report_errors_name_the_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "pip install relayrl[plots]" in capsys.readouterr().err


@pytest.mark.slow
def test_report_two_async_runs(tmp_path: Path) -> None:
    """Two async runs (eta 0 and eta 2, the engine in its own process): staleness and
    utilisation are drawn, and the report says each run's schedule."""
    model = build_tiny_model(tmp_path / "m", hidden_size=16, seed=0)
    runs = [
        _run(model, tmp_path / f"eta{eta}", "schedule=async", f"async.eta={eta}", "train.steps=6")
        for eta in (0, 2)
    ]
    out = tmp_path / "report"
    assert main(["report", *map(str, runs), "-o", str(out)]) == 0
    text = _check_report(out, runs, [*CORE_PNGS, "staleness.png", "utilisation.png"])
    assert f"| eta0 | `{runs[0]}` | grpo | async | 6 |" in text
    assert "## Engine and trainer utilisation" in text

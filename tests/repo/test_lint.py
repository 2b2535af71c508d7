"""``make test`` holds the code to ``make lint``: ``ruff check`` and ``ruff format --check`` over
the sources, tests, benches and tools, and mypy over ``src/relayrl`` with pyproject.toml's
config, pass (both are in the locked dev extra). mypy without its cache takes about a minute on
one core; it writes its cache to a temporary directory, not the tree's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")
TREES = ["src", "tests", "bench", "tools"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes(args: list[str]) -> None:
    if not RUFF.exists():
        pytest.skip(f"no ruff next to {sys.executable}")
    run = subprocess.run(
        [str(RUFF), *args, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"ruff {' '.join(args)}:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"


def test_mypy_passes(tmp_path: Path) -> None:
    mypy = Path(sys.executable).with_name("mypy")
    if not mypy.exists():
        pytest.skip(f"no mypy next to {sys.executable}")
    run = subprocess.run(
        [str(mypy), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"mypy:\n{run.stdout[-4000:]}{run.stderr[-2000:]}"

"""Tiny ``relayrl train`` runs for the run-directory and fault tests: an untrained 16-wide
model, 2 prompts x 2 answers of at most 4 tokens a step, 2 eval prompts. A step takes
milliseconds; a run's time is the interpreter start-up."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TINY_RUN = [
    "threads=1",
    "logging.progress=false",
    "logging.tensorboard=false",
    "algo.prompts_per_step=2",
    "algo.group_size=2",
    "rollout.max_tokens=4",
    "data.eval_size=2",
]


def write_config(path: Path, model: Path, run_dir: Path) -> Path:
    """A YAML run config for ``model`` in ``run_dir`` (the rest from ``TINY_RUN``)."""
    path.write_text(f"model:\n  path: {model}\nrun_dir: {run_dir}\n")
    return path


def train_argv(config: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return ["train", str(config), *TINY_RUN, *overrides, *flags]


def run_cli(capsys: Any, argv: list[str]) -> tuple[int, str]:
    """``relayrl.cli.main(argv)`` in this process: its exit code and its stderr, stripped
    (``capsys``: pytest's fixture, read and cleared)."""
    from relayrl.cli import main

    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


@contextmanager
def mounted_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (created here), unmounted (lazily) on leaving;
    the test is skipped where it cannot mount one (not root, or no tmpfs)."""
    import pytest

    where.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (the fault-injected test covers the message)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def cli(*argv: str, **popen: object) -> subprocess.Popen[str]:
    """``python -m relayrl.cli ARGV`` in a subprocess (stdout discarded, stderr piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,  # type: ignore[arg-type]
    )


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120):
    """Wait until ``metrics.jsonl`` holds a training record of ``step`` or later."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()}")
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if '"reward_mean"' in line and int(line.split(",")[0].split(":")[1]) >= step:
                    return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {metrics} within {timeout} s")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a live process from ``/proc``, None when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (by ``/proc`` parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                parents[int(entry)] = st[1]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int], wait: float = 10.0) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone) after up to ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        left = {p for p in pids if (st := _stat(p)) is not None and st[0] != "Z"}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def varied_reward(prompt: str, completion: str, sample: dict) -> float:
    """A reward that differs between the answers of a group even for an untrained model (the
    arithmetic verifier scores them all 0: no advantage, no weight change)."""
    return float(sum(map(ord, completion)) % 5)

"""SFT steps of the demo model with fixed 2 threads vs ``threads: auto``, idle and with one
CPU-bound process beside them (the issue-15 measurement of why the demo slowed under load; the
figures: docs/measurements.md, ``model/threads.py`` row).

With more torch threads than idle cores every parallel region waits at a barrier for the
thread the kernel has descheduled; ``auto`` takes the CPUs idle at start. Each case runs in
its own process (``relayrl sft``-equivalent ``run_sft``, ``--steps`` steps, no validation).
Prints one JSON line: seconds per case and the under-load slow-down of each policy.

    .venv/bin/python bench/threads_under_load.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relayrl.demo import DEMO_ARITHMETIC, TINY
from relayrl.model import build_tiny_model


def _busy() -> None:
    while True:
        pass


def _sft_seconds(base: Path, out: Path, steps: int, threads: int | str) -> float:
    """Wall seconds of ``steps`` SFT steps in a fresh process (its own torch thread pool)."""
    code = (
        "import time; from relayrl.config import SFTConfig, ArithmeticConfig;"
        "from relayrl.controller.sft import run_sft; t = time.perf_counter();"
        f"run_sft(SFTConfig(model_path={str(base)!r}, output_dir={str(out)!r}, steps={steps},"
        f" threads={threads!r}, progress=False,"
        f" arithmetic=ArithmeticConfig(**{DEMO_ARITHMETIC!r})));"
        "print(time.perf_counter() - t)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(Path(tmp) / "base", **TINY)
        out: dict[str, float] = {}
        for load in (False, True):
            busy = mp.Process(target=_busy, daemon=True) if load else None
            if busy is not None:
                busy.start()
                time.sleep(1.0)
            try:
                for threads in (2, "auto"):
                    key = f"{'load' if load else 'idle'}_threads_{threads}_s"
                    out[key] = round(_sft_seconds(base, Path(tmp) / "sft", args.steps, threads), 2)
            finally:
                if busy is not None:
                    busy.terminate()
    out["slowdown_under_load_threads_2"] = round(
        out["load_threads_2_s"] / out["idle_threads_2_s"], 2
    )
    out["slowdown_under_load_auto"] = round(
        out["load_threads_auto_s"] / out["idle_threads_auto_s"], 2
    )
    print(json.dumps({"bench": "threads_under_load", "steps": args.steps, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of the ``code`` reward: scores/s for a trivial correct program, before and after.

Prints ONE JSON line. A ``RewardService`` with the ``code`` reward scores ``--samples``
completions of a correct ``add`` against two assert tests, with 1 and 2 worker processes,
for two source trees: ``after`` (this checkout's ``src``) and ``before`` (``--before-ref``,
default ``main``, exported with ``git archive`` into a temporary directory). Each
measurement runs in a fresh interpreter with that tree first on ``PYTHONPATH``, after a
warm-up (the isolation probe). ``slowdown_wN`` = before / after scores/s (the issue's bar:
isolation must not make it slower than 2x, i.e. ``slowdown <= 2``).

    .venv/bin/python bench/code_reward.py [--samples 40 --before-ref main]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from git_export import src_at

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = r"""
import json, sys, time
from relayrl.reward import RewardMix, RewardService, detect_isolation
n, workers = int(sys.argv[1]), int(sys.argv[2])
sample = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}
completion = "```python\ndef add(a, b):\n    return a + b\n```"
mode = detect_isolation()
with RewardService(RewardMix(["code"]), num_workers=workers, timeout_s=60) as svc:
    for f in [svc.submit_text("", completion, sample) for _ in range(2 * workers)]:
        f.result(timeout=120)  # warm-up: worker start and the isolation probe
    t0 = time.monotonic()
    futs = [svc.submit_text("", completion, sample) for _ in range(n)]
    scores = [f.result(timeout=300).score for f in futs]
    dt = time.monotonic() - t0
assert all(s == 1.0 for s in scores), scores
print(json.dumps({"scores_per_s": n / dt, "isolation": mode}))
"""


def _measure(src: Path, n: int, workers: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(n), str(workers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(ROOT),
    )
    if out.returncode != 0:
        raise SystemExit(f"bench/code_reward.py: measuring {src} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--before-ref", default="main")
    args = ap.parse_args()
    result: dict = {"samples": args.samples, "before_ref": args.before_ref}
    with src_at(args.before_ref) as before:
        trees = {"before": before, "after": ROOT / "src"}
        for workers in (1, 2):
            for name, src in trees.items():
                t0 = time.monotonic()
                m = _measure(src, args.samples, workers)
                result[f"{name}_w{workers}"] = round(m["scores_per_s"], 2)
                result[f"{name}_isolation"] = m["isolation"]
                result[f"{name}_w{workers}_wall_s"] = round(time.monotonic() - t0, 1)
            result[f"slowdown_w{workers}"] = round(
                result[f"before_w{workers}"] / result[f"after_w{workers}"], 2
            )
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""What each ``logging.backends`` entry costs a run: import, start, 10 steps of 60 scalars,
the summary and close, each backend in its own fresh process (torch already imported, as in
the trainer). Prints one JSON line per backend: wall and CPU seconds (CPU includes the
children that exited, e.g. wandb-core) for the start and for the whole.

Also checks that the default path imports neither wandb nor mlflow.

    .venv/bin/python bench/tracker_startup.py [none tensorboard wandb mlflow]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time

BACKENDS = ["none", "tensorboard", "wandb", "mlflow"]


def _cpu() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(backend: str) -> dict[str, float | str]:
    import torch  # noqa: F401  (loaded in every trainer process already)

    from relayrl.telemetry import MetricsLogger

    assert "wandb" not in sys.modules and "mlflow" not in sys.modules
    t0, c0 = time.perf_counter(), _cpu()
    with tempfile.TemporaryDirectory() as d:
        logger = MetricsLogger(
            d, backends=[] if backend == "none" else [backend], config={"algo": {"kl": 0.1}}
        )
        t1, c1 = time.perf_counter(), _cpu()
        for step in range(1, 11):
            logger.log(step, {f"m{i}": step * i * 0.1 for i in range(60)})
        logger.log_summary({"eval_after": 0.5})
        logger.close()
    return {
        "backend": backend,
        "start_wall_s": round(t1 - t0, 3),
        "start_cpu_s": round(c1 - c0, 3),
        "total_wall_s": round(time.perf_counter() - t0, 3),
        "total_cpu_s": round(_cpu() - c0, 3),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(sys.argv[2])))
        sys.exit(0)
    for backend in sys.argv[1:] or BACKENDS:
        out = subprocess.run(
            [sys.executable, __file__, "--one", backend], capture_output=True, text=True
        )
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr)

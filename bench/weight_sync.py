"""Weight-sync seconds trainer -> rollout replicas on a pool of their own, by transport.

For tiny 2-layer models of growing hidden size: ``weight_sync.transport`` ``object_store``
(rank 0's dict put in Ray's object store, every replica fetches it) against ``collective``
(trainer rank 0 and the replicas in a gloo group of their own, bucketed broadcast), each the
median of ``--repeats`` syncs (``RayRolloutClient.update_weights``, interrupt off), with
``--replicas`` replicas. Prints one JSON line.

    RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 PYTHONPATH=src python bench/weight_sync.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import torch  # noqa: E402

from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.config import RunConfig, load_config  # noqa: E402
from relayrl.model import build_tiny_model, load_causal_lm  # noqa: E402


def sync_seconds(model: Path, run: Path, transport: str, replicas: int, repeats: int) -> float:
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={run}",
            "cluster=ray",
            f"weight_sync.transport={transport}",
            "threads=1",
            f"ray.pools={{trainer: {{bundles: 1, cpus_per_bundle: 0.5}}, "
            f"rollout: {{bundles: {replicas}, cpus_per_bundle: 0.5}}}}",
            "ray.placement={actor: trainer, rollout: rollout}",
            f"ray.rollout_replicas={replicas}",
        ],
    )
    roles = build_ray_roles(cfg, str(model), None)
    try:
        times = []
        for v in range(1, repeats + 1):
            t0 = time.perf_counter()
            roles.rollout.update_weights(roles.actor.state_dict(), version=v, interrupt=False)
            times.append(time.perf_counter() - t0)
    finally:
        roles.close()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for h in args.hidden:
            model = build_tiny_model(root / f"m{h}", hidden_size=h, num_layers=2, num_heads=4)
            state = load_causal_lm(model, torch.float32).state_dict()
            n = sum(t.numel() * t.element_size() for t in state.values())
            row: dict[str, float] = {"hidden_size": h, "mbytes": round(n / 2**20, 1)}
            for transport in ("object_store", "collective"):
                s = sync_seconds(
                    model, root / f"r{h}{transport}", transport, args.replicas, args.repeats
                )
                row[f"{transport}_s"] = round(s, 4)
            rows.append(row)
    ray.shutdown()
    print(json.dumps({"bench": "weight_sync", "replicas": args.replicas, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

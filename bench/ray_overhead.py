"""Ray backend overhead: per-step time against the local backend, weight-sync latency vs size.

1. The same GRPO sync run (tiny model, same seed) on ``cluster: local`` and on ``cluster:
   ray`` with all roles colocated in one Ray actor; the ratio of mean per-step times (first
   step excluded: warm-up) is the cost of the Ray hop (experience and stats pickled to the
   worker and back, the rollout client's threads). The two runs produce the same metrics.
2. Weight sync trainer -> one rollout replica on its own pool, through the object store
   (``ray.put`` once, the replica fetches and loads), for tiny models of growing size.

Prints one JSON line.

    RAY_AUTH_MODE=disabled .venv/bin/python bench/ray_overhead.py [--steps 20] [--quick]
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

from relayrl.cluster.local import build_local_roles  # noqa: E402
from relayrl.cluster.ray_roles import build_ray_roles  # noqa: E402
from relayrl.config import RunConfig, load_config  # noqa: E402
from relayrl.controller.trainer import train  # noqa: E402
from relayrl.model import build_tiny_model  # noqa: E402


def _cfg(model: Path, run_dir: Path, *extra: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={run_dir}",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "algo.prompts_per_step=16",
            "algo.group_size=4",
            "data.eval_size=8",
            *extra,
        ],
    )


def _step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step"] for r in rows if "time/step" in r][1:]


def step_ratio(root: Path, model: Path, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    local = _cfg(model, root / "local", f"train.steps={steps}")
    train(local, lambda a, c: build_local_roles(local, a, c))
    remote = _cfg(model, root / "ray", f"train.steps={steps}", "cluster=ray")
    t0 = time.perf_counter()
    train(remote, lambda a, c: build_ray_roles(remote, a, c))
    out["ray_run_wall_s"] = time.perf_counter() - t0
    lt, rt = _step_times(root / "local"), _step_times(root / "ray")
    out["local_step_s"] = statistics.median(lt)
    out["ray_step_s"] = statistics.median(rt)
    out["ray_over_local_step_ratio"] = out["ray_step_s"] / out["local_step_s"]
    return out


def sync_latency(root: Path, hidden_sizes: list[int], repeats: int) -> list[dict[str, float]]:
    rows = []
    for h in hidden_sizes:
        model = build_tiny_model(root / f"m{h}", hidden_size=h, num_layers=2, num_heads=4)
        cfg = _cfg(
            model,
            root / f"sync{h}",
            "cluster=ray",
            "schedule=async",
            "ray.pools={trainer: {bundles: 1}, rollout: {bundles: 1}}",
            "ray.placement={actor: trainer, rollout: rollout}",
        )
        roles = build_ray_roles(cfg, str(model), None)
        try:
            n_bytes = sum(
                t.numel() * t.element_size() for t in roles.actor.model.state_dict().values()
            )
            times_remote, times_put = [], []
            for v in range(1, repeats + 1):  # actor state -> object store -> replica
                t0 = time.perf_counter()
                roles.rollout.update_weights(roles.actor.state_dict(), version=v, interrupt=False)
                times_remote.append(time.perf_counter() - t0)
            state = roles.actor.model.state_dict()
            for v in range(repeats + 1, 2 * repeats + 1):  # controller dict -> put -> replica
                t0 = time.perf_counter()
                roles.rollout.update_weights(state, version=v, interrupt=False)
                times_put.append(time.perf_counter() - t0)
        finally:
            roles.close()
        rows.append(
            {
                "hidden_size": h,
                "mbytes": n_bytes / 2**20,
                "sync_from_actor_s": statistics.median(times_remote),
                "sync_from_driver_s": statistics.median(times_put),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer model sizes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sizes = [64, 256] if args.quick else [64, 256, 512, 1024]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny", hidden_size=96)
        result: dict[str, object] = {"bench": "ray_overhead", "steps": args.steps}
        result.update(step_ratio(root, model, args.steps))
        result["weight_sync"] = sync_latency(root, sizes, args.repeats)
    ray.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time ``PromptSource``: construction and ``for_step`` per step, at several dataset sizes.

    OMP_NUM_THREADS=1 python bench/prompt_sampling.py --rows 2048 100000 1000000 --per-step 64

``--format``: the training file as JSONL (default), one Parquet file, or a directory written
by ``datasets.Dataset.save_to_disk`` (``hf``); the rows are the same in every format.

Prints one JSON line per size: ``build_s`` (start-up: load + hold out + the rows tokenised at
start; ``build_cpu_s`` the same in this process's CPU time, steadier on a shared machine),
``step0_s`` (the first step), ``step1_ms`` / ``step50_ms`` (one step each, in milliseconds),
``steps_ms_mean`` (mean of steps 1..``--steps``), ``fresh_steps_ms_mean`` /
``fresh_steps_ms_median``: steps past the rows tokenised at start (each tokenises its
prompts on the first draw; the same as the others where everything was tokenised at start).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from relayrl.config import RunConfig, load_config
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer


def _write(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": f"{i % 1000}+{i // 1000}=", "answer": i}) + "\n")


def _write_format(d: Path, rows: int, fmt: str) -> Path:
    """The training file of ``rows`` rows in ``fmt`` (jsonl, parquet or hf)."""
    if fmt == "jsonl":
        path = d / f"train{rows}.jsonl"
        _write(path, rows)
        return path
    import pyarrow as pa

    table = pa.table(
        {"prompt": [f"{i % 1000}+{i // 1000}=" for i in range(rows)], "answer": list(range(rows))}
    )
    if fmt == "parquet":
        import pyarrow.parquet as pq

        path = d / f"train{rows}.parquet"
        pq.write_table(table, path)
        return path
    import datasets

    path = d / f"train{rows}_hf"
    datasets.Dataset(table).save_to_disk(str(path))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 100_000, 1_000_000])
    ap.add_argument("--per-step", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-step-s", type=float, default=60.0, help="stop timing steps after this")
    ap.add_argument("--format", choices=["jsonl", "parquet", "hf"], default="jsonl")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_tiny_model(Path(d) / "m", hidden_size=16))
        for rows in a.rows:
            path = _write_format(Path(d), rows, a.format)
            cfg = load_config(RunConfig, None, ["data.task=jsonl", f"data.train_path={path}"]).data
            t, c = time.perf_counter(), time.process_time()
            src = PromptSource(cfg, tok, seed=0)
            build, build_cpu = time.perf_counter() - t, time.process_time() - c
            times = []
            t_all = time.perf_counter()
            for step in range(a.steps + 1):
                t = time.perf_counter()
                src.for_step(step, a.per_step)
                times.append(time.perf_counter() - t)
                if time.perf_counter() - t_all > a.max_step_s:
                    break
            fresh = []
            first_fresh = 4096 // a.per_step + 1
            for step in range(first_fresh, first_fresh + a.steps):
                t = time.perf_counter()
                src.for_step(step, a.per_step)
                fresh.append(time.perf_counter() - t)
            out = {
                "rows": rows,
                "format": a.format,
                "per_step": a.per_step,
                "build_s": round(build, 3),
                "build_cpu_s": round(build_cpu, 3),
                "step0_s": round(times[0], 4),
                "step1_ms": round(1e3 * times[1], 3) if len(times) > 1 else None,
                "step50_ms": round(1e3 * times[50], 3) if len(times) > 50 else None,
                "steps_timed": len(times) - 1,
                "steps_ms_mean": round(1e3 * sum(times[1:]) / max(1, len(times) - 1), 3),
                "fresh_steps_ms_mean": round(1e3 * sum(fresh) / len(fresh), 3),
                "fresh_steps_ms_median": round(1e3 * sorted(fresh)[len(fresh) // 2], 3),
            }
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""On-policy distillation over seeds: does the student's held-out pass rate rise toward its
teacher's?

Per seed: the teacher is the SFT-warm-started tiny model (hidden 96) after 60 GRPO steps (or
``--teacher DIR`` / ``--teachers`` with ``{seed}``), the student a hidden-48 tiny model SFT'd
only to 12% validation pass rate. From the student, 60 GRPO steps each of: GRPO alone, reverse
KL to the teacher as the only advantage (``algo.distill.task_reward=false``), and distillation
plus the task reward. Each run's held-out greedy pass rate (the run seed's held-out set, the
same the teacher's run evaluates on) before and after; the teacher's beside it. Prints one
JSON line per seed (and the runs' lines on stderr).

    .venv/bin/python bench/distill.py --seeds 0,1,2
    .venv/bin/python bench/distill.py --seeds 1 --teachers 'r{seed}/checkpoints/step_000060/actor'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, DataConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer

ARITH = {"min_operand": 0, "max_operand": 99, "operators": ["+"], "num_operands": 2}
ARMS: dict[str, list[str]] = {
    "grpo": [],
    "distill_alone": ["algo.distill.task_reward=false"],
    "distill_plus_task": [],
}


def sft(root: Path, seed: int, hidden: int, target: float) -> Path:
    """A tiny Llama SFT'd to ``target`` validation pass rate, the held-out set left out."""
    base = build_tiny_model(root / "base", hidden_size=hidden, seed=seed)
    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    held = {p.record.prompt for p in PromptSource(data, load_tokenizer(base), seed).eval_set()}
    cfg = SFTConfig(
        seed=seed, model_path=str(base), output_dir=str(root / "sft"),
        arithmetic=ArithmeticConfig(**ARITH), steps=3000, eval_every=20, eval_size=200,
        target_pass_rate=target, threads=1, progress=False,
    )  # fmt: skip
    run_sft(cfg, exclude_prompts=held)
    return root / "sft"


def grpo(model: Path, run_dir: Path, seed: int, steps: int, *overrides: str) -> dict:
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}", f"run_dir={run_dir}", f"seed={seed}", "threads=1",
            "logging.progress=false", "logging.tensorboard=false", f"train.steps={steps}",
            "data.eval_size=200", *overrides,
        ],
    )  # fmt: skip
    t0 = time.perf_counter()
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def one_seed(seed: int, root: Path, args) -> dict:
    steps = args.steps
    if args.teachers:
        teacher = Path(args.teachers.format(seed=seed))
        teacher_eval = grpo(teacher, root / "teacher_eval", seed, 1)["eval_before"]
    else:
        warm = sft(root / "teacher_sft", seed, 96, 0.35)
        run = grpo(warm, root / "teacher", seed, steps)
        teacher = root / "teacher" / "checkpoints" / f"step_{steps:06d}" / "actor"
        teacher_eval = run["eval_after"]
    student = sft(root / "student", seed, 48, 0.12)
    line: dict = {"seed": seed, "teacher": teacher_eval}
    for name, extra in ARMS.items():
        distill = [] if name == "grpo" else [f"algo.distill.teacher_path={teacher}"]
        out = grpo(student, root / name, seed, steps, *distill, *extra)
        line[name] = {"before": out["eval_before"], "after": out["eval_after"]}
        if "distill/reverse_kl" in out:
            line[name]["reverse_kl_last"] = out["distill/reverse_kl"]
        print(json.dumps({"seed": seed, "run": name, **line[name], "s": out["seconds"]}),
              file=sys.stderr, flush=True)  # fmt: skip
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--teachers", help="teacher dir per seed, with {seed} (default: train one)")
    p.add_argument("--work", type=Path, help="keep the runs here (default: a temporary dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for seed in (int(s) for s in args.seeds.split(",")):
            print(json.dumps(one_seed(seed, work / f"seed{seed}", args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())

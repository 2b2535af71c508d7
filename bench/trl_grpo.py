"""GRPO head-to-head: relayrl against TRL's ``GRPOTrainer`` on the same tiny Llama and task.

Both sides start from the same SFT-warm-started tiny Llama (2-digit addition, as the test
fixture), draw the same prompts in the same order (relayrl's ``PromptSource`` draws for steps
0..N-1 are TRL's dataset, unshuffled), use the same batch (``--prompts`` x ``--group``), lr
(constant, no warm-up), AdamW betas/eps, grad clip, token-mean loss (TRL ``loss_type=dapo``),
std-scaled group advantages, no KL (TRL's default ``beta=0``), temperature 1, fp32, one
optimizer update per step, and one torch thread. Checkpoints every ``--eval-every`` steps are
scored afterwards by ONE shared greedy evaluation (``shared_eval``: relayrl's engine, greedy, on
the held-out prompts, the arithmetic verifier), so neither side's own eval code is trusted.

Arms: ``trl``; ``relayrl`` (matched to TRL key by key); ``relayrl_defaults`` (relayrl's own
defaults for what the matched arm changes: ``mini_batches=2``, ``warmup_steps=10``,
``betas=(0.9, 0.99)``), to show what each side's defaults do to sample efficiency.
Modes: ``short`` (completions capped at 8 tokens) and ``long`` (128).

    OMP_NUM_THREADS=1 python bench/trl_grpo.py --modes short long --seeds 0 1 2 --steps 40

Prints one JSON line per (mode, seed, arm): ``s_per_step``, ``pass_rate`` by step (step 0 =
the SFT model), ``wall_s_to_target`` (training time until the first evaluated step at or
above ``--target``; null if never), and a last line with the per-mode means.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402

from relayrl.config import ArithmeticConfig, DataConfig, RunConfig, SFTConfig, load_config  # noqa: E402
from relayrl.controller.prompts import PromptSource, TokenizedPrompt  # noqa: E402

ARITH = dict(min_operand=0, max_operand=99, operators=["+"], num_operands=2)
MAX_LEN = {"short": 8, "long": 128}
EVAL_TOKENS = 8


def sft_model(root: Path, seed: int, target: float) -> Path:
    """The test fixture's warm start (tests/helpers.py ``make_sft_model``), cached in ``root``."""
    out = root / f"sft_seed{seed}"
    if (out / "config.json").exists():
        return out
    from relayrl.controller.sft import run_sft
    from relayrl.model import build_tiny_model, load_tokenizer

    base = build_tiny_model(root / f"base_seed{seed}", hidden_size=96, seed=seed)
    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    held = {p.record.prompt for p in PromptSource(data, load_tokenizer(base), seed).eval_set()}
    cfg = SFTConfig(
        seed=seed,
        model_path=str(base),
        output_dir=str(out),
        arithmetic=ArithmeticConfig(**ARITH),
        steps=3000,
        eval_every=20,
        eval_size=200,
        target_pass_rate=target,
        threads=1,
        progress=False,
    )
    run_sft(cfg, exclude_prompts=held)
    return out


def held_out(model: Path, seed: int, n: int) -> list[TokenizedPrompt]:
    from relayrl.model import load_tokenizer

    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    return PromptSource(data, load_tokenizer(model), seed).eval_set()[:n]


def shared_eval(model_dir: Path, prompts: list[TokenizedPrompt]) -> float:
    """Greedy pass rate of the model saved in ``model_dir`` on ``prompts`` (one function for
    both sides: relayrl's engine, greedy, ``EVAL_TOKENS`` tokens, the arithmetic verifier)."""
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.reward.functions import arithmetic
    from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=64
    )
    params = SamplingParams(greedy=True, max_tokens=EVAL_TOKENS)
    samples = engine.generate([GenerationRequest(p.ids, params) for p in prompts])
    ok = 0
    for p, s in zip(prompts, samples, strict=True):
        text = tok.decode(s.response_ids, skip_special_tokens=True)
        ok += arithmetic(p.record.prompt, text, p.fields()) >= 1.0
    return ok / len(prompts)


def relayrl_overrides(a: argparse.Namespace, mode: str, matched: bool) -> list[str]:
    common = [
        f"algo.prompts_per_step={a.prompts}",
        f"algo.group_size={a.group}",
        "algo.loss_agg=token-mean",
        "algo.kl_coef=0.0",
        f"optim.lr={a.lr}",
        "optim.grad_clip=1.0",
        "optim.weight_decay=0.0",
        f"rollout.max_tokens={MAX_LEN[mode]}",
        "rollout.temperature=1.0",
        "data.eval_size=200",
    ]
    if matched:  # TRL's values for what relayrl's defaults set otherwise
        common += ["algo.mini_batches=1", "optim.warmup_steps=0", "optim.betas=[0.9,0.999]"]
    return common


def run_relayrl(a, mode: str, seed: int, model: Path, out: Path, matched: bool) -> dict:
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train

    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={out}",
            f"seed={seed}",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"train.steps={a.steps}",
            f"train.save_every={a.eval_every}",
            f"train.keep_checkpoints={a.steps}",
            *relayrl_overrides(a, mode, matched),
        ],
    )
    t = time.perf_counter()
    train(cfg, lambda actor, critic: build_local_roles(cfg, actor, critic))
    wall = time.perf_counter() - t
    ckpts = {
        int(p.name.split("_")[1]): p / "actor"
        for p in (out / "checkpoints").iterdir()
        if p.name.startswith("step_")
    }
    return {"wall_s": wall, "checkpoints": ckpts, "step_times": _relayrl_step_times(out)}


def _relayrl_step_times(out: Path) -> list[float]:
    times = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for k in ("time/step_s", "time/step"):
            if k in row:
                times.append(float(row[k]))
                break
    return times


def trl_prompts(model: Path, seed: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    """relayrl's draws for steps 0..steps-1, in order: TRL's (unshuffled) dataset."""
    from relayrl.model import load_tokenizer

    cfg = load_config(RunConfig, None, [f"seed={seed}", "data.eval_size=200"])
    src = PromptSource(cfg.data, load_tokenizer(model), seed)
    rows = []
    for step in range(a.steps):
        for p in src.for_step(step, a.prompts):
            rows.append({"prompt": p.record.prompt, "answer": str(p.record.answer)})
    return rows


def run_trl(a, mode: str, seed: int, model: Path, out: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.model import load_tokenizer
    from relayrl.reward.functions import arithmetic

    def reward(prompts, completions, answer, **_: Any) -> list[float]:
        return [
            arithmetic(p, c, {"answer": x})
            for p, c, x in zip(prompts, completions, answer, strict=True)
        ]

    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t)

    n = a.prompts * a.group
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=seed,
        max_steps=a.steps,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=a.group,
        max_completion_length=MAX_LEN[mode],
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        temperature=1.0,
        shuffle_dataset=False,
        save_strategy="steps",
        save_steps=a.eval_every,
        save_only_model=True,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tok = load_tokenizer(model)
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(trl_prompts(model, seed, a)),
        processing_class=tok,
        callbacks=[Timer()],
    )
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    ckpts = {
        int(p.name.split("-")[1]): p for p in out.iterdir() if p.name.startswith("checkpoint-")
    }
    return {"wall_s": wall, "checkpoints": ckpts, "step_times": step_times}


def summarise(name: str, mode: str, seed: int, res: dict, base: float, prompts, a) -> dict:
    rates = {0: base}
    for step, path in sorted(res["checkpoints"].items()):
        rates[step] = shared_eval(path, prompts)
    st = res["step_times"]
    s_per_step = (sum(st) / len(st)) if st else res["wall_s"] / a.steps
    to_target = None
    for step, r in sorted(rates.items()):
        if r >= a.target:
            to_target = round(step * s_per_step, 2)
            break
    return {
        "bench": "trl_grpo",
        "arm": name,
        "mode": mode,
        "seed": seed,
        "steps": a.steps,
        "s_per_step": round(s_per_step, 4),
        "train_wall_s": round(res["wall_s"], 2),
        "pass_rate": {str(k): round(v, 3) for k, v in rates.items()},
        "target": a.target,
        "wall_s_to_target": to_target,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["short", "long"], choices=list(MAX_LEN))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", default=["relayrl", "trl", "relayrl_defaults"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--sft-target", type=float, default=0.35)
    ap.add_argument(
        "--sft-seed", type=int, default=None, help="one SFT model for every run seed (default: own)"
    )
    ap.add_argument("--work", default=os.environ.get("RELAYRL_BENCH_DIR", "bench_out/trl_grpo"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in a.seeds:
        sft_seed = seed if a.sft_seed is None else a.sft_seed
        model = sft_model(work, sft_seed, a.sft_target)
        prompts = held_out(model, sft_seed, a.eval_prompts)
        base = shared_eval(model, prompts)
        for mode in a.modes:
            for arm in a.arms:
                out = work / f"{arm}_{mode}_seed{seed}"
                shutil.rmtree(out, ignore_errors=True)
                if arm == "trl":
                    res = run_trl(a, mode, seed, model, out)
                elif arm in ("relayrl", "relayrl_defaults"):
                    res = run_relayrl(a, mode, seed, model, out, matched=arm == "relayrl")
                else:
                    raise SystemExit(f"--arms: unknown arm {arm!r}")
                row = summarise(arm, mode, seed, res, base, prompts, a)
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"bench": "trl_grpo", "summary": _means(rows)}), flush=True)


def _means(rows: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in rows:
        d = out.setdefault(f"{r['arm']}/{r['mode']}", {"s_per_step": [], "final": []})
        d["s_per_step"].append(r["s_per_step"])
        d["final"].append(r["pass_rate"][max(r["pass_rate"], key=int)])
    return {
        k: {m: round(sum(v) / len(v), 4) for m, v in d.items()} | {"n": len(d["final"])}
        for k, d in out.items()
    }


if __name__ == "__main__":
    sys.exit(main())

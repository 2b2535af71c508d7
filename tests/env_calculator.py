"""The calculator tool task end to end: SFT on synthetic tool-use traces, then GRPO through
the trainer (``relayrl train``'s code), held-out pass rates with and without the tool.

Run as a script to measure over seeds (numbers in the report of issue 20)::

    PYTHONPATH=src:tests python tests/env_calculator.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from relayrl.cluster.local import build_local_roles
from relayrl.config import ArithmeticConfig, DataConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.checkpoint import latest_checkpoint
from relayrl.controller.evaluate import greedy_pass_rate
from relayrl.controller.prompts import PromptSource, arithmetic_task
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data import write_jsonl
from relayrl.env.builtin.calculator import make_calculator_env, sft_traces
from relayrl.env.render import PlainRenderer
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import EpisodeScorer
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.reward import get_reward_fn
from relayrl.rollout import RolloutEngine
from relayrl.workers.reward import RewardWorker

MUL = dict(min_operand=10, max_operand=99, operators=["*"], num_operands=2)
TURN_TOKENS = 80
EVAL_SIZE = 200


def data_config() -> DataConfig:
    return DataConfig(arithmetic=ArithmeticConfig(**MUL), eval_size=EVAL_SIZE)


def make_calculator_sft(root: Path, seed: int = 0, steps: int = 300, hidden: int = 96) -> Path:
    """Tiny Llama + SFT on tool-use traces (half with the tool, half answering directly) of
    problems outside the RL held-out set."""
    base = build_tiny_model(root / "base", hidden_size=hidden, seed=seed)
    tok = load_tokenizer(base)
    held = {p.record.prompt for p in PromptSource(data_config(), tok, seed).eval_set()}
    task = arithmetic_task(ArithmeticConfig(**MUL), seed=seed + 1)
    rows = [r for r in task.sample(6000) if r.prompt not in held]
    path = root / "traces.jsonl"
    write_jsonl(path, sft_traces(rows, tok.eos_token, tool_fraction=0.5, seed=seed))
    cfg = SFTConfig(
        seed=seed,
        model_path=str(base),
        output_dir=str(root / "sft"),
        task="jsonl",
        train_path=str(path),
        steps=steps,
        batch_size=32,
        lr=3e-3,
        threads=1,
        progress=False,
    )
    run_sft(cfg)
    return root / "sft"


def grpo_config(model: Path, run_dir: Path, seed: int, *overrides: str) -> RunConfig:
    return load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={run_dir}",
            f"seed={seed}",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "data.arithmetic.operators=['*']",
            "data.arithmetic.min_operand=10",
            "data.arithmetic.max_operand=99",
            f"data.eval_size={EVAL_SIZE}",
            "env.factory=calculator",
            "env.max_turns=3",
            f"rollout.max_tokens={TURN_TOKENS}",
            "rollout.max_slots=64",
            "reward.fn=arithmetic",
            *overrides,
        ],
    )


def pass_rate(model_path: Path, seed: int, tools: bool, n: int = EVAL_SIZE) -> float:
    """Greedy held-out pass rate of episodes (max 3 turns) with or without the tool."""
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=64
    )
    runner = EpisodeRunner(
        engine,
        lambda: make_calculator_env(tools=tools),
        PlainRenderer(tok),
        RunnerLimits(max_turns=3, max_turn_tokens=TURN_TOKENS, max_model_len=256),
    )
    scorer = EpisodeScorer(RewardWorker(get_reward_fn("arithmetic"), tok))
    prompts = PromptSource(data_config(), tok, seed).eval_set()[:n]
    try:
        res = greedy_pass_rate(runner, scorer, prompts, TURN_TOKENS, [tok.eos_token_id])
    finally:
        runner.close()
    return res["eval/pass_rate"]


def run_grpo(model: Path, run_dir: Path, seed: int, *overrides: str) -> dict[str, Any]:
    cfg = grpo_config(model, run_dir, seed, *overrides)
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--root", default="/work/logs/i20a/calc")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    for seed in args.seeds:
        root = Path(args.root) / f"seed{seed}"
        t0 = time.time()
        sft = make_calculator_sft(root, seed, args.sft_steps)
        t1 = time.time()
        before = {
            "with_tool": pass_rate(sft, seed, True),
            "without_tool": pass_rate(sft, seed, False),
        }
        out = run_grpo(
            sft,
            root / "grpo",
            seed,
            f"train.steps={args.grpo_steps}",
            "train.save_every=0",
            *args.overrides,
        )
        t2 = time.time()
        ckpt = latest_checkpoint(root / "grpo")
        assert ckpt is not None
        after = {
            "with_tool": pass_rate(ckpt / "actor", seed, True),
            "without_tool": pass_rate(ckpt / "actor", seed, False),
        }
        print(
            json.dumps(
                {
                    "seed": seed,
                    "sft": before,
                    "grpo": after,
                    "trainer_eval_before": out["eval_before"],
                    "trainer_eval_after": out["eval_after"],
                    "sft_s": round(t1 - t0),
                    "grpo_s": round(t2 - t1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

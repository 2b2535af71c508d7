"""The calculator tool task end to end: SFT on synthetic tool-use traces, then GRPO through
the trainer (``relayrl train``'s code), held-out pass rates with and without the tool.

The SFT trains only the model-written tokens (the tool results are untrained segments) and
stops at a with-tool validation pass rate (``SFT_TARGET``), well below this model's ceiling
(~0.85), so GRPO has room to raise it. Run as a script to measure over seeds (numbers in the
report of issue 20; one JSON line per seed, the SFT's validation curve in
``ROOT/sft_seedN.log``)::

    PYTHONPATH=src:tests/support python tests/support/env_calculator.py --seeds 0 1 2 \
        [--sft lr=1e-3 ...]
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
from relayrl.controller.sft import run_sft
from relayrl.controller.trainer import train
from relayrl.data import write_jsonl
from relayrl.data.prompts import PromptSource, arithmetic_task, tokenize_prompts
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


SFT_TARGET = 0.3
"""With-tool greedy pass rate on a validation stream at which the SFT warm start stops."""
SFT = dict(hidden=96, lr=3e-3, tool_fraction=0.5, eval_every=10, val_size=100, max_steps=1500)
"""The warm start's settings (measured in issue 20's report)."""


def make_calculator_sft(
    root: Path,
    seed: int = 0,
    target: float = SFT_TARGET,
    log: Any = None,
    **over: Any,
) -> tuple[Path, dict[str, float]]:
    """Tiny Llama + SFT (``relayrl sft``'s ``run_sft``, one optimizer throughout) on tool-use
    traces (``tool_fraction`` with the tool, the rest answering directly; the tool results
    are untrained segments) of problems outside the RL held-out set, stopped as soon as the
    with-tool greedy episode pass rate on ``val_size`` validation problems (neither trained
    on nor held out), checked every ``eval_every`` steps, reaches ``target``: a quality, not
    a step count, as the arithmetic fixture (``helpers.make_sft_model``). ``over``: settings
    of ``SFT``. Returns the model and ``run_sft``'s figures (``sft/steps``,
    ``sft/val_pass_rate``)."""
    opt = {**SFT, **over}
    base = build_tiny_model(root / "base", hidden_size=opt["hidden"], seed=seed)
    tok = load_tokenizer(base)
    held = {p.record.prompt for p in PromptSource(data_config(), tok, seed).eval_set()}
    task = arithmetic_task(ArithmeticConfig(**MUL), seed=seed + 1)
    rows = [r for r in task.sample(6100) if r.prompt not in held]
    val_rows, rows = rows[: opt["val_size"]], rows[opt["val_size"] :]
    val = tokenize_prompts(val_rows, tok, 10**9)[0]
    path = root / "traces.jsonl"
    write_jsonl(path, sft_traces(rows, tok.eos_token, opt["tool_fraction"], seed=seed))
    cfg = SFTConfig(
        seed=seed,
        model_path=str(base),
        output_dir=str(root / "sft"),
        task="jsonl",
        train_path=str(path),
        steps=opt["max_steps"],
        batch_size=32,
        lr=opt["lr"],
        warmup_steps=20,
        eval_every=opt["eval_every"],
        target_pass_rate=target,
        threads=1,
        progress=False,
    )
    steps = [0]

    def validate(model: Any) -> float:
        steps[0] += opt["eval_every"]
        rate = episode_pass_rate(model, tok, True, val)
        if log is not None:
            print(json.dumps({"seed": seed, "sft_step": steps[0], "val": rate}), file=log)
            log.flush()
        return rate

    out = run_sft(cfg, validate=validate)
    return root / "sft", out


GRPO_STEPS = 30
GRPO = ("algo.prompts_per_step=16", "algo.group_size=8", "optim.lr=2e-4")
"""GRPO's settings from the warm start (issue 20's report)."""


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


def episode_pass_rate(model: Any, tok: Any, tools: bool, prompts: Any) -> float:
    """Greedy pass rate of calculator episodes (max 3 turns) with or without the tool."""
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
    try:
        res = greedy_pass_rate(runner, scorer, prompts, TURN_TOKENS, [tok.eos_token_id])
    finally:
        runner.close()
    return res["eval/pass_rate"]


def pass_rate(
    model_path: Path, seed: int, tools: bool, n: int = EVAL_SIZE, prompts: Any = None
) -> float:
    """Greedy pass rate of episodes (max 3 turns) with or without the tool, on the RL
    held-out set (or ``prompts``)."""
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path).eval()
    if prompts is None:
        prompts = PromptSource(data_config(), tok, seed).eval_set()[:n]
    return episode_pass_rate(model, tok, tools, prompts)


def run_grpo(model: Path, run_dir: Path, seed: int, *overrides: str) -> dict[str, Any]:
    cfg = grpo_config(model, run_dir, seed, *overrides)
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--root", default="/work/logs/i20d/calc")
    ap.add_argument("--sft-target", type=float, default=SFT_TARGET)
    ap.add_argument(
        "--sft", nargs="*", default=[], help="SFT settings KEY=VALUE (of SFT, e.g. lr=1e-3)"
    )
    ap.add_argument("--sft-only", action="store_true", help="stop after the SFT")
    ap.add_argument("--sft-model", default=None, help="skip SFT: start GRPO from this model")
    ap.add_argument("--grpo-steps", type=int, default=GRPO_STEPS)
    ap.add_argument("overrides", nargs="*", help="GRPO config overrides (after GRPO)")
    args = ap.parse_args()
    over = {k: type(SFT[k])(float(v)) for k, v in (kv.split("=", 1) for kv in args.sft)}
    for seed in args.seeds:
        root = Path(args.root) / f"seed{seed}"
        t0 = time.time()
        if args.sft_model:
            sft, sft_out = Path(args.sft_model), {}
        else:
            root.mkdir(parents=True, exist_ok=True)
            with (root.parent / f"sft_seed{seed}.log").open("w") as log:
                sft, sft_out = make_calculator_sft(root, seed, args.sft_target, log, **over)
        t1 = time.time()
        before = {
            "with_tool": pass_rate(sft, seed, True),
            "without_tool": pass_rate(sft, seed, False),
        }
        head = {"seed": seed, "sft": before, "sft_run": sft_out, "sft_s": round(t1 - t0)}
        if args.sft_only:
            print(json.dumps(head), flush=True)
            continue
        out = run_grpo(
            sft,
            root / "grpo",
            seed,
            f"train.steps={args.grpo_steps}",
            "train.save_every=0",
            *(args.overrides or GRPO),
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
                    **head,
                    "grpo": after,
                    "trainer_eval_before": out["eval_before"],
                    "trainer_eval_after": out["eval_after"],
                    "grpo_s": round(t2 - t1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

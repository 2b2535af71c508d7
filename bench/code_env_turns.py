"""Multi-turn code environment: pass rate against the number of allowed turns, on one fixed model.

A tiny Llama is SFT'd on the shipped code task's traces (``relayrl.env.builtin.code``: one-turn
solutions and repair traces), then evaluated on held-out rows through the episode runner and the
real code sandbox with ``env.max_turns`` = 1, 2, 3, 4 (sampling at temperature 1, the same seeds
for every K: turn 1 is the same sample in every run, so the pass rate can only gain from the
turns after it). Prints one JSON line: ``pass_rate_by_turns``, turns used, SFT steps and seconds.

    python bench/code_env_turns.py --sft-steps 600 --episodes 96
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from relayrl.config import SFTConfig
from relayrl.controller.sft import run_sft
from relayrl.env.builtin.code import CodeEnv, code_task_rows, sft_traces
from relayrl.env.render import PlainRenderer
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.env.scoring import episode_scores
from relayrl.model import build_tiny_model, load_causal_lm, load_tokenizer
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

EVAL_SEED = 10_007  # held-out rows: another stream than the SFT rows


def sft_code_model(root: Path, steps: int, seed: int = 0, n_rows: int = 20_000) -> Path:
    """Tiny Llama + SFT on the code task's traces (``sft_traces``), ``steps`` steps."""
    base = build_tiny_model(root / "base", hidden_size=96, seed=seed)
    eos = load_tokenizer(base).eos_token
    traces = sft_traces(code_task_rows(n_rows, seed=seed), eos, repair_fraction=0.3, seed=seed)
    train = root / "code_sft.jsonl"
    train.write_text("".join(json.dumps(t) + "\n" for t in traces))
    cfg = SFTConfig(
        seed=seed,
        model_path=str(base),
        output_dir=str(root / "sft"),
        task="jsonl",
        train_path=str(train),
        steps=steps,
        batch_size=64,
        threads=1,
        progress=False,
    )
    run_sft(cfg)
    return root / "sft"


def pass_rate(model_dir: Path, max_turns: int, episodes: int, seed: int = 0) -> dict[str, float]:
    """Fraction of held-out episodes solved within ``max_turns`` turns (and turns used)."""
    model, tok = load_causal_lm(model_dir).eval(), load_tokenizer(model_dir)
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # the sandbox queue counts against a step's timeout: a generous one on a loaded machine
    limits = RunnerLimits(
        max_turns=max_turns, max_turn_tokens=32, max_model_len=256, step_timeout_s=120.0
    )
    runner = EpisodeRunner(engine, CodeEnv, PlainRenderer(tok), limits, concurrency=4)
    rows = code_task_rows(episodes, seed=EVAL_SEED + seed)
    reqs = [
        GenerationRequest([], SamplingParams(max_tokens=32, seed=seed * 1000 + i), metadata=row)
        for i, row in enumerate(rows)
    ]
    try:
        samples = runner.generate(reqs)
        metrics = runner.env_metrics()
    finally:
        runner.close()
    scores = episode_scores(samples, torch.zeros(len(samples)), outcome="env")
    return {
        "pass_rate": float(scores.mean()),
        "turns_mean": metrics.get("env/turns_mean", 0.0),
        "failures": metrics.get("env/failures", 0.0),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--episodes", type=int, default=96)
    p.add_argument("--turns", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="an SFT'd model dir (skip the SFT)")
    p.add_argument("--keep", type=Path, default=None, help="build the model here and keep it")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        model = a.model or sft_code_model(a.keep or Path(d), a.sft_steps, seed=a.seed)
        t_sft = time.perf_counter() - t0
        by_k = {k: pass_rate(model, k, a.episodes, seed=a.seed) for k in a.turns}
    out = {
        "bench": "code_env_turns",
        "sft_steps": a.sft_steps,
        "sft_s": round(t_sft, 1),
        "episodes": a.episodes,
        "pass_rate_by_turns": {k: round(v["pass_rate"], 4) for k, v in by_k.items()},
        "turns_mean_by_turns": {k: round(v["turns_mean"], 3) for k, v in by_k.items()},
        "failures": sum(v["failures"] for v in by_k.values()),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])

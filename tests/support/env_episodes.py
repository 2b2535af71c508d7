"""Shared set-up for the tests that drive an outside environment package through relayrl's
environment path (tests/integration/test_env_openenv.py, tests/integration/test_env_skyrl.py):
one scripted episode through the episode runner with the Qwen2.5 template, and two GRPO steps
of a tiny model through the trainer with ``env.factory`` set.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env import ChatTemplateRenderer
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.rollout import GenerationRequest, SamplingParams


def run_episode(
    factory: Callable[..., Any],
    replies: list[str],
    row: dict[str, Any],
    max_turns: int = 4,
    isolation: str = "thread",
) -> tuple[Any, Any]:
    """One episode of ``factory``'s environment on ``row``, the model's turns being
    ``replies`` in order (a ``ScriptedEngine``): (the Qwen tokenizer, the episode's sample)."""
    tok = qwen_tokenizer()
    runner = EpisodeRunner(
        ScriptedEngine(tok, replies),
        factory,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=max_turns, max_model_len=4096),
        isolation=isolation,
    )
    req = GenerationRequest([1], SamplingParams(max_tokens=80), metadata=row)
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    return tok, s


def env_tiny_model(root: Path) -> Path:
    """The tiny model the GRPO runs train (hidden size 32, seed 1)."""
    from relayrl.model import build_tiny_model

    return build_tiny_model(root / "m", hidden_size=32, seed=1)


def train_through_env(model: Path, run_dir: Path, factory: str, *overrides: str) -> list[dict]:
    """Two GRPO steps (2 prompts x 2 samples, up to 2 turns of 8 tokens) through
    ``env.factory=factory`` with the environment's outcome as the reward; asserts every
    step ran its 4 episodes without a failure, each ended by the env or the turn cap, with
    1 to 2 turns on average, and took an optimizer step with a finite gradient norm.
    Returns the steps' metrics records."""
    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train

    cfg = run_config(
        model,
        run_dir,
        f"env.factory={factory}",
        "env.outcome=env",
        "env.max_turns=2",
        "rollout.max_tokens=8",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "data.eval_size=2",
        "train.steps=2",
        "train.save_every=0",
        *overrides,
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes"] == 4 and r.get("env/failures", 0) == 0
        assert r["env/stop_env_done"] + r.get("env/stop_max_turns", 0) == 4
        assert 1 <= r["env/turns_mean"] <= 2
        assert r["actor/optimizer_steps"] > 0 and math.isfinite(r["actor/grad_norm"])
    return steps

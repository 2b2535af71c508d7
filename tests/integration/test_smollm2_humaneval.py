"""SmolLM2-135M-Instruct (``relayrl models fetch smollm2``) on HumanEval with the recipe
``configs/grpo_smollm2_humaneval.yaml``: the default run loads the real model and takes one
real GRPO step (LoRA, chat template, completions run against the problem's asserts in the
sandbox), the held-out problems never among the training prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import recipe_config
from relayrl.cluster.local import build_local_roles
from relayrl.config import RunConfig
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.model.fetch import fetch_model
from relayrl.reward import get_reward_fn

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "grpo_smollm2_humaneval.yaml"


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return fetch_model("smollm2")


def _config(model: Path, run_dir: Path, *overrides: str) -> RunConfig:
    return recipe_config(RECIPE, model, run_dir, *overrides)


def test_recipe_holds_out_problems_and_scores_in_the_sandbox(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    cfg = _config(smol_dir, smol_dir / "unused")
    assert cfg.data.train_path == "humaneval" and cfg.reward.fn == "humaneval"
    assert cfg.model.lora is not None and cfg.data.source.chat_template
    tok = AutoTokenizer.from_pretrained(smol_dir)
    source = PromptSource(cfg.data, tok, cfg.seed)
    held = source.eval_set()
    assert len(held) == cfg.data.eval_size
    held_ids = {p.record.extra["task_id"] for p in held}
    drawn = [p for step in range(30) for p in source.for_step(step, 2)]
    assert held_ids.isdisjoint(p.record.extra["task_id"] for p in drawn)
    assert all(len(p.ids) <= cfg.data.max_prompt_tokens for p in [*held, *drawn])
    # the reward the recipe names runs the problem's asserts: its own solution passes them
    fn = get_reward_fn(cfg.reward.fn)
    s = held[0].record.as_sample()
    whole = f"```python\n{s['code_prompt']}{s['canonical_solution']}```"
    assert fn(held[0].record.prompt, whole, s)["score"] == 1.0
    assert fn(held[0].record.prompt, "```python\npass\n```", s)["score"] == 0.0


def test_one_grpo_step_on_humaneval(smol_dir: Path, tmp_path: Path) -> None:
    cfg = _config(
        smol_dir,
        tmp_path / "run",
        "train.steps=1",
        "train.eval_every=0",
        "data.eval_size=2",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=24",
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    step = next(r for r in rows if r.get("step") == 1 and "actor/loss" in r)
    assert torch.isfinite(torch.tensor(step["actor/loss"]))
    assert step["actor/optimizer_steps"] >= 1
    assert 0.0 <= step["reward_mean"] <= 1.0
    assert out["eval_before"] is not None and out["eval_after"] is not None

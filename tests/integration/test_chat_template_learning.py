"""Issue 44's show: a Qwen2 whose tokenizer has a chat template goes through the default
configs (``configs/sft_arithmetic.yaml``, then ``configs/grpo_arithmetic.yaml``) with overrides
only for the model path, sizes and steps, in one prompt format: the template.

The fast test runs SFT -> GRPO for two steps each with the Qwen2.5 chat template and checks,
at the model's input, that both rendered every prompt through it. The slow one trains to a
held-out pass rate and checks that it rises after SFT and again after GRPO."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from helpers import TEST_SEED
from qwen_template import QWEN25_TEMPLATE, QWEN_CHARS, ROLE_TEMPLATE
from relayrl.cli import main
from relayrl.model import build_tiny_model, load_tokenizer
from relayrl.telemetry import read_metrics

SFT_CONFIG = "configs/sft_arithmetic.yaml"
GRPO_CONFIG = "configs/grpo_arithmetic.yaml"
QUIET = ["threads=1"]
QUIET_RL = [*QUIET, "logging.progress=false", "logging.tensorboard=false"]


def _qwen2_with_qwen25_template(out: Path) -> Path:
    """A 16-wide Qwen2 and the character tokenizer with ``<|im_start|>`` / ``<|im_end|>`` and
    the Qwen2.5 instruct template (the embedding resized to the two special tokens)."""
    build_tiny_model(out, arch="qwen2", hidden_size=16, chars=QWEN_CHARS, seed=TEST_SEED)
    tok = load_tokenizer(out)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN25_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(out)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_sft_then_grpo_from_the_default_configs_both_render_the_chat_template(
    tmp_path, capsys, monkeypatch
):
    from relayrl.controller import sft
    from relayrl.rollout.engine import RolloutEngine

    base = _qwen2_with_qwen25_template(tmp_path / "qwen2")
    tok = load_tokenizer(base)
    sft_inputs: list[str] = []
    rl_prompts: list[str] = []
    real_forward, real_generate = sft.forward_logprobs, RolloutEngine.generate

    def forward(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        pad = tok.pad_token
        sft_inputs.extend(tok.decode(row).replace(pad, "") for row in batch.input_ids.tolist())
        return real_forward(model, batch, *args, **kwargs)

    def generate(self: RolloutEngine, requests: list[Any]) -> Any:
        rl_prompts.extend(tok.decode(r.prompt_ids) for r in requests)
        return real_generate(self, requests)

    monkeypatch.setattr(sft, "forward_logprobs", forward)
    monkeypatch.setattr(RolloutEngine, "generate", generate)

    sft_out, run = tmp_path / "sft", tmp_path / "grpo"
    argv = ["sft", SFT_CONFIG, f"model_path={base}", f"output_dir={sft_out}", "steps=2"]
    assert main([*argv, "batch_size=4", "progress=false", *QUIET]) == 0
    argv = ["train", GRPO_CONFIG, f"model.path={sft_out}", f"run_dir={run}", "train.steps=2"]
    sizes = ["algo.prompts_per_step=2", "algo.group_size=2", "data.eval_size=2"]
    assert main([*argv, *sizes, "train.save_every=1", *QUIET_RL]) == 0
    assert "was fine-tuned on prompts" not in capsys.readouterr().err  # no format warning

    head = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n"
    )
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert len(sft_inputs) == 8 and len(rl_prompts) >= 2 * 2 * 2
    for text in sft_inputs:  # prompt through the template, then the answer
        assert tail in text, repr(text)
        prompt, answer = text.split(tail)
        assert prompt.startswith(head) and prompt[len(head) :].endswith("=")
        assert answer.removesuffix(tok.eos_token).isdigit(), text
    for text in rl_prompts:  # training and held-out prompts alike
        assert text.startswith(head) and text.endswith("=" + tail), text
    expected = {"format": "chat_template", "system_prompt": None}
    assert json.loads((sft_out / "prompt_format.json").read_text()) == expected
    actor = run / "checkpoints/step_000002/actor"
    assert json.loads((actor / "prompt_format.json").read_text()) == expected


def _held_out_pass_rate(tmp_path: Path, model: Path, *overrides: str) -> float:
    """``relayrl eval`` of ``model`` on the GRPO config's held-out set (greedy)."""
    out = tmp_path / f"eval-{model.name}-{len(overrides)}.jsonl"
    argv = ["eval", GRPO_CONFIG, f"model.path={model}", f"seed={TEST_SEED}", *QUIET_RL]
    assert main([*argv, *overrides, "--output", str(out)]) == 0
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    return float(next(iter(summary.values()))["pass_rate"])


@pytest.mark.slow
@pytest.mark.learning
def test_a_chat_template_qwen2_learns_through_sft_then_grpo(tmp_path, capsys, outcome):
    """A 96-wide Qwen2 whose tokenizer has a (short) chat template: SFT in the template (the
    default) to its validation target, then 60 GRPO steps; the held-out greedy pass rate (200
    prompts) asked in the same format rises after both, and asking the SFT model raw (the old
    SFT's format) is worse. Seeds 0-2 (docs/first-run.md, 7 min each on 2 busy cores): before
    SFT 0.0 each; after SFT min / median 0.405 / 0.475 (raw: at most 0.005); GRPO's gain min /
    median 0.285 / 0.39."""
    base = build_tiny_model(tmp_path / "base", arch="qwen2", hidden_size=96, seed=TEST_SEED)
    tok = load_tokenizer(base)
    tok.chat_template = ROLE_TEMPLATE
    tok.save_pretrained(base)
    sft_out, run = tmp_path / "sft", tmp_path / "grpo"

    before_sft = _held_out_pass_rate(tmp_path, base)
    argv = ["sft", SFT_CONFIG, f"model_path={base}", f"output_dir={sft_out}", f"seed={TEST_SEED}"]
    sft_args = ["target_pass_rate=0.35", "eval_every=20", "steps=3000", "progress=false"]
    assert main([*argv, *sft_args, *QUIET]) == 0
    assert json.loads((sft_out / "prompt_format.json").read_text())["format"] == "chat_template"
    after_sft = _held_out_pass_rate(tmp_path, sft_out)
    raw = _held_out_pass_rate(tmp_path, sft_out, "data.source.chat_template=false")

    argv = ["train", GRPO_CONFIG, f"model.path={sft_out}", f"run_dir={run}", f"seed={TEST_SEED}"]
    rl_args = ["train.steps=60", "train.eval_every=0", "train.save_every=0"]
    assert main([*argv, *rl_args, *QUIET_RL]) == 0
    evals = [r["eval/pass_rate"] for r in read_metrics(run) if "eval/pass_rate" in r]
    capsys.readouterr()
    outcome(
        before_sft=before_sft, after_sft=after_sft, raw=raw, grpo_before=evals[0], after=evals[-1]
    )
    assert after_sft >= before_sft + 0.2, (before_sft, after_sft)
    assert raw < after_sft, (raw, after_sft)
    assert evals[0] == after_sft  # GRPO's first held-out eval is the same greedy eval
    assert evals[-1] >= evals[0] + 0.1, evals

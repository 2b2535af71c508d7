"""The calculator tool task: the tool, its traces (token-exact with what the runner renders),
and (slow) the learning result: GRPO raises the with-tool pass rate after SFT, while the same
model without the tool stays low."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.controller.sft import tokenize_pair
from relayrl.data import ArithmeticTask, SFTRecord
from relayrl.env import PlainRenderer
from relayrl.env.builtin.calculator import (
    CalculatorEnv,
    calculator,
    sft_traces,
    tool_call_text,
)
from relayrl.env.registry import resolve_factory
from relayrl.model.tiny import build_char_tokenizer

RISE = 0.1
"""Least rise of the held-out greedy with-tool pass rate over GRPO (measured: +0.15 minimum, +0.36
median over seeds 0-4 and the default kernels, see the learning test)."""


def test_calculator_tool_evaluates_integer_expressions_only():
    assert calculator("37*58") == "2146"
    assert calculator(" (2+3)*-4 ") == "-20"
    for bad in ("2**1000", "__import__('os')", "1/2", "x" * 70):
        with pytest.raises(ValueError):
            calculator(bad)


def test_sft_traces_tokenise_exactly_as_the_runner_renders_the_episode():
    tok = build_char_tokenizer()
    (row,) = ArithmeticTask(seed=0, min_operand=10, max_operand=99, operators=("*",)).sample(1)
    (trace,) = sft_traces([row], tok.eos_token, tool_fraction=1.0)
    prompt, response = tokenize_pair(tok, SFTRecord(trace["prompt"], trace["response"]))
    env = CalculatorEnv(tools=True)
    r = PlainRenderer(tok)
    first = asyncio.run(env.reset({"prompt": row.prompt}))
    assert prompt == r.prompt(first)
    call = tool_call_text(row.prompt.rstrip("="))
    turn1 = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    result = asyncio.run(env.step({"role": "assistant", "content": call}))
    assert not result.done and result.observation[0]["content"] == row.answer
    obs = r.observation(result.observation)
    turn2 = tok(row.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert response == turn1 + obs + turn2
    assert asyncio.run(env.step({"role": "assistant", "content": row.answer})).done


def test_without_the_tool_a_call_is_an_unknown_tool():
    env = resolve_factory("calculator", {"tools": False})()
    first = asyncio.run(env.reset({"prompt": "12*34="}))
    assert first == [{"role": "user", "content": "12*34="}]
    out = asyncio.run(env.step({"role": "assistant", "content": tool_call_text("12*34")}))
    assert out.observation[0]["content"].startswith("error: unknown tool 'calculator'")
    with pytest.raises(ValueError, match="env.factory: unknown environment 'nope'"):
        resolve_factory("nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_mod'"):
        resolve_factory("no_such_mod:f")


@pytest.mark.slow
@pytest.mark.learning
def test_grpo_raises_the_with_tool_pass_rate(tmp_path, outcome):
    """SFT on masked tool traces stopped at a with-tool validation pass rate of 0.3 (checked
    every 10 steps, one optimizer), then 30 GRPO steps (16 prompts x 8, lr 2e-4): the greedy
    held-out pass rate with the tool rises, the same model without the tool stays near 0.
    Measured (issue 20's report; held-out greedy with tool SFT -> GRPO, without tool SFT ->
    GRPO; SFT steps): avx2 seed 0 0.27 -> 0.655, 0.01 -> 0.01 (310); seed 1 0.40 -> 0.76,
    0.0 -> 0.0 (280); seed 2 0.275 -> 0.805, 0.0 -> 0.005 (450); ATEN_CPU_CAPABILITY=default
    seed 0 0.335 -> 0.695, 0.0 -> 0.0 (630); avx2 seed 3 0.485 -> 0.635, 0.01 -> 0.0 (580: the
    SFT overshot its target, 0.24 -> 0.42 in 10 steps, leaving less room); seed 4 0.61 ->
    0.865, 0.0 -> 0.0 (570, overshot to 0.6); rise min +0.15, median +0.36. 10-45 min on 2
    cores, by load (the SFT takes 280-630 steps; 624 s for seed 0 beside other work)."""
    from env_calculator import (
        GRPO,
        GRPO_STEPS,
        SFT_TARGET,
        make_calculator_sft,
        pass_rate,
        run_grpo,
    )
    from helpers import TEST_SEED
    from relayrl.controller.checkpoint import latest_checkpoint

    sft, sft_out = make_calculator_sft(tmp_path, TEST_SEED)
    assert sft_out["sft/val_pass_rate"] >= SFT_TARGET, sft_out
    before = pass_rate(sft, TEST_SEED, True)
    without = pass_rate(sft, TEST_SEED, False)
    run_grpo(
        sft,
        tmp_path / "grpo",
        TEST_SEED,
        f"train.steps={GRPO_STEPS}",
        "train.save_every=0",
        *GRPO,
    )
    ckpt = latest_checkpoint(tmp_path / "grpo")
    assert ckpt is not None
    after = pass_rate(ckpt / "actor", TEST_SEED, True)
    after_without = pass_rate(ckpt / "actor", TEST_SEED, False)
    outcome(
        sft_steps=sft_out["sft/steps"],
        before=before,
        after=after,
        without_before=without,
        without_after=after_without,
    )
    assert after >= before + RISE, (before, after)
    assert max(without, after_without) <= 0.05, (without, after_without)

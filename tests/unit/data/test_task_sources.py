"""The built-in task sources (issue 38): ``reasoning_gym:<task>`` with the task's own scorer on
answers parsed from free text, ``humaneval`` with tests converted to the harness's assert form
and run in the sandbox, and the held-out split that never overlaps training."""

from __future__ import annotations

import pytest
import reasoning_gym

from relayrl.config import DataConfig
from relayrl.data import DataError
from relayrl.data import load_prompts as load_prompt_dataset
from relayrl.data.humaneval_source import convert_tests, humaneval_records, skipped_problems
from relayrl.data.prompts import PromptSource
from relayrl.data.task_sources import parse_spec
from relayrl.model.tiny import build_char_tokenizer
from relayrl.reward import get_reward_fn
from relayrl.reward.task_rewards import extract_task_answer

EASY = "reasoning_gym:basic_arithmetic?size=600&seed=0&max_terms=2&max_digits=1"


def test_spec_parsing_and_one_line_errors() -> None:
    name, params = parse_spec(
        "reasoning_gym:chain_sum?size=10&seed=3&allow_negation=true&x=a,b&ops=+,-"
    )
    assert name == "reasoning_gym:chain_sum"
    assert params == {
        "size": 10,
        "seed": 3,
        "allow_negation": True,
        "x": ("a", "b"),
        "ops": ("+", "-"),
    }
    with pytest.raises(DataError, match="unknown reasoning_gym task 'basic_arith'"):
        load_prompt_dataset("reasoning_gym:basic_arith")
    with pytest.raises(DataError, match="reasoning_gym rejects the config"):
        load_prompt_dataset("reasoning_gym:chain_sum?size=3&no_such_key=1")
    with pytest.raises(DataError, match="size must be a positive integer"):
        load_prompt_dataset("reasoning_gym:chain_sum?size=0")
    with pytest.raises(DataError, match="file not found"):
        load_prompt_dataset("reasoning_gym_typo.jsonl")


def test_reasoning_gym_rows_are_seeded_and_carry_the_scorer_fields() -> None:
    a = load_prompt_dataset("reasoning_gym:chain_sum?size=20&seed=1")
    assert [r.prompt for r in a] == [
        r.prompt for r in load_prompt_dataset("reasoning_gym:chain_sum?size=20&seed=1")
    ]
    assert [r.prompt for r in a] != [
        r.prompt for r in load_prompt_dataset("reasoning_gym:chain_sum?size=20&seed=2")
    ]
    ds = reasoning_gym.create_dataset("chain_sum", size=20, seed=1)
    assert [r.prompt for r in a] == [e["question"] for e in ds]
    assert [r.answer for r in a] == [e["answer"] for e in ds]
    assert (
        a[0].extra["rg_task"] == "chain_sum" and a[0].extra["domain"] == "reasoning_gym:chain_sum"
    )


@pytest.mark.parametrize(
    ("text", "ref", "want"),
    [
        ("Let me think. 3 + 4 = 7. The answer is <answer>7</answer>", "7", "7"),
        ("5 - 3 - 6 = -4", "-4", "-4"),
        ("The total is 1,234.", "1234", "1234"),
        ("It is 12.0<|im_end|> 99", "12", "12"),
        ("no number here", "3", None),
        ("first line\nsecond line\n", "abc", "second line"),
    ],
)
def test_answer_extraction(text: str, ref: str, want: str | None) -> None:
    assert extract_task_answer(text, ref) == want


def test_reasoning_gym_reward_is_the_tasks_own_score() -> None:
    fn = get_reward_fn("reasoning_gym")
    rows = load_prompt_dataset("reasoning_gym:basic_arithmetic?size=30&seed=5")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=30, seed=5)
    for row, entry in zip(rows, ds, strict=True):
        right = fn(row.prompt, f"Working it out... so the result is {row.answer}", row.as_sample())
        assert right == {"score": 1.0, "answered": 1.0}
        wrong_text = f"{row.answer}9"
        got = fn(row.prompt, wrong_text, row.as_sample())["score"]
        assert got == pytest.approx(ds.score_answer(wrong_text, entry)) and got < 1.0
    assert fn(rows[0].prompt, "I don't know", rows[0].as_sample())["answered"] == 0.0
    with pytest.raises(ValueError, match="reasoning_gym:<task>"):
        fn("q", "1", {"answer": "1"})


def test_held_out_split_never_overlaps_training() -> None:
    """One- and two-digit sums repeat: a held-out prompt's duplicates are dropped from training
    too, so no step ever draws a held-out problem."""
    cfg = DataConfig(task="jsonl", train_path=EASY, eval_size=200, max_prompt_tokens=64)
    source = PromptSource(cfg, build_char_tokenizer(), seed=0)
    held = {p.record.prompt for p in source.eval_set()}
    assert len(source.eval_set()) == 200
    rows = load_prompt_dataset(EASY)
    assert len({r.prompt for r in rows}) < len(rows)  # duplicates exist: the case that matters
    drawn = {p.record.prompt for step in range(40) for p in source.for_step(step, 16)}
    assert drawn and not drawn & held
    assert {p.record.extra["rg_task"] for p in source.for_step(0, 4)} == {"basic_arithmetic"}


def test_humaneval_tests_convert_and_canonical_solutions_pass_in_the_sandbox() -> None:
    records = humaneval_records()
    skipped = skipped_problems()
    assert len(records) + len(skipped) == 164 and len(records) >= 150
    fn = get_reward_fn("humaneval")
    for rec in records[:: len(records) // 6][:6]:  # six problems across the set
        s = rec.as_sample()
        whole = f"```python\n{s['code_prompt']}{s['canonical_solution']}```"
        assert fn(rec.prompt, whole, s)["score"] == 1.0, rec.extra["task_id"]
        body_only = s["canonical_solution"]  # a completion that writes just the body
        assert fn(rec.prompt, body_only, s)["score"] == 1.0, rec.extra["task_id"]
    first = records[0].as_sample()
    wrong = f"```python\ndef {first['entry_point']}(numbers, threshold):\n    return False\n```"
    out = fn(records[0].prompt, wrong, first)
    assert out["score"] == 0.0 and 0.0 < out["tests_passed"] < 1.0


def test_humaneval_conversion_rules() -> None:
    src = "import math\nMETADATA = {}\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
    assert convert_tests(src, "inc") == ["import math\nassert inc(1) == 2"]
    loop = "def check(candidate):\n    for i in range(3):\n        assert candidate(i)\n"
    assert convert_tests(loop, "f") is None
    helper = "def helper():\n    return 1\n\ndef check(candidate):\n    assert candidate(1)\n"
    assert convert_tests(helper, "f") is None

"""ArithmeticTask: determinism, answer correctness, streams, config validation."""

import pytest

from relayrl.data import ArithmeticTask, PromptRecord, SFTRecord
from relayrl.reward import arithmetic


def _eval_prompt(prompt: str) -> int:
    assert prompt.endswith("=")
    expr = prompt[:-1]
    assert set(expr) <= set("0123456789+-*()"), expr
    return eval(expr)  # safe: only digits, operators and parentheses


def test_default_task_shape() -> None:
    records = ArithmeticTask(seed=0).sample(50)
    assert len(records) == 50
    for r in records:
        assert isinstance(r, PromptRecord)
        a, b = r.prompt[:-1].split("+")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert r.answer == str(int(a) + int(b))
        assert r.extra == {}


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"operators": ("+", "-")},
        {"operators": ("*",), "max_operand": 99},
        {"operators": "+-*", "num_operands": 4, "min_operand": -20, "max_operand": 20},
        {"operators": ["-"], "min_operand": 5, "max_operand": 5},
    ],
)
def test_answers_equal_python_eval(config: dict) -> None:
    task = ArithmeticTask(seed=3, **config)
    for r in (
        task.sample(200)
        + task.held_out(50)
        + [PromptRecord(s.prompt, s.response) for s in task.sft_records(50)]
    ):
        assert r.answer == str(_eval_prompt(r.prompt)), r


def test_hand_computed_precedence_and_negatives() -> None:
    # Found by construction: the evaluator binds '*' tighter and parenthesises negatives.
    task = ArithmeticTask(seed=1, min_operand=-5, max_operand=20, operators="+-*", num_operands=3)
    texts = {r.prompt: r.answer for r in task.sample(200)}
    for prompt, answer in texts.items():
        assert "--" not in prompt and "+-" not in prompt and "*-" not in prompt
        assert answer == str(_eval_prompt(prompt))
    assert any("*" in p for p in texts)
    assert any("(-" in p for p in texts)
    assert any(a.startswith("-") for a in texts.values())


def test_minus_gives_negative_answers() -> None:
    answers = [int(r.answer) for r in ArithmeticTask(operators=("-",)).sample(200)]
    assert min(answers) < 0 and max(answers) > 0


def test_deterministic_across_instances() -> None:
    a, b = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert a.sample(30) == b.sample(30)
    assert a.held_out(30) == b.held_out(30)
    assert a.sft_records(30) == b.sft_records(30)
    assert ArithmeticTask(seed=7).sample(30) != ArithmeticTask(seed=8).sample(30)


def test_sample_advances_and_is_split_invariant() -> None:
    whole = ArithmeticTask(seed=2, max_operand=99).sample(40)
    task = ArithmeticTask(seed=2, max_operand=99)
    parts = task.sample(10) + task.sample(0) + task.sample(30)
    assert parts == whole
    assert task.cursor == 40
    assert whole[:10] != whole[10:20]


def test_state_dict_resume() -> None:
    straight = ArithmeticTask(seed=4, max_operand=99)
    straight.sample(25)
    expected = straight.sample(5)
    first = ArithmeticTask(seed=4, max_operand=99)
    first.sample(25)
    resumed = ArithmeticTask(seed=4, max_operand=99)
    resumed.load_state_dict(first.state_dict())
    assert resumed.sample(5) == expected


def test_held_out_is_a_different_stream() -> None:
    task = ArithmeticTask(seed=0, max_operand=999)
    train = [r.prompt for r in ArithmeticTask(seed=0, max_operand=999).sample(100)]
    held = [r.prompt for r in task.held_out(100)]
    assert task.cursor == 0  # held_out does not consume training problems
    assert len(set(train) & set(held)) < 5  # 10^6 possible problems: overlap is chance only
    assert task.held_out(100) == task.held_out(100)  # fixed eval set
    assert task.held_out(100, seed=1) != task.held_out(100)
    assert [r.prompt for r in task.held_out(100, seed=0)] == held


def test_sft_records() -> None:
    records = ArithmeticTask(seed=5).sft_records(20)
    assert all(isinstance(r, SFTRecord) for r in records)
    for r in records:
        assert r.response == str(_eval_prompt(r.prompt))


def test_records_score_with_arithmetic_reward() -> None:
    task = ArithmeticTask(seed=0, operators="+-*")
    assert task.reward_fn == "arithmetic"
    for r in task.sample(20):
        assert arithmetic(r.prompt, r.answer + "</s>", r.as_sample()) == 1.0
        assert arithmetic(r.prompt, str(int(r.answer) + 1), r.as_sample()) == 0.0


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"operators": ("+", "/")}, "'/'"),
        ({"operators": ("**",)}, "'**'"),
        ({"operators": "+x"}, "'x'"),
        ({"operators": ()}, "operators must not be empty"),
        ({"min_operand": 5, "max_operand": 4}, "min_operand (5) must be <= max_operand (4)"),
        ({"num_operands": 1}, "num_operands must be >= 2"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"max_operand": "9"}, "max_operand must be an int"),
    ],
)
def test_config_validation(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        ArithmeticTask(**config)
    assert fragment in str(info.value)


def test_negative_n_rejected() -> None:
    with pytest.raises(ValueError, match="n must be"):
        ArithmeticTask().sample(-1)

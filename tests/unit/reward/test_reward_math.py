"""Math answer verification: a table of tricky answers with expected verdicts, and
never-raise / never-hang properties (model output is untrusted: nothing is eval-ed)."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.reward import (
    answers_equal,
    extract_final_answer,
    get_reward_fn,
    math_answer,
    parse_answer,
    verify_math,
)

# (completion, reference answer, expected verdict)
TABLE = [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is 0.5", "1/2", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{3}", "-3", False),
    ("\u22127", "-7", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{5\\text{ cm}}", "5", True),
    ("It is 5 cm", "5", True),
    ("\\boxed{50\\%}", "50", True),
    ("\\boxed{50\\%}", "0.5", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{3.14}", "\\pi", False),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    ("", "5", False),
    ("   ", "5", False),
    ("asdf qwerty", "5", False),
    ("\\boxed{", "5", False),
    ("First 3, then 4, finally 5", "5", True),
    ("5 apples and 3 pears", "5", False),
    ("\\boxed{7} (checked in 2 steps)", "7", True),
    ("\\boxed{3} no wait \\boxed{4}", "4", True),
    ("\\boxed{0.333}", "\\frac{1}{3}", False),
    ("\\boxed{0.3333333}", "1/3", True),
    ("x = 5", "5", True),
    ("\\boxed{x=5}", "5", True),
    ("\\boxed{10^{3}}", "1000", True),
    ("\\boxed{1e3}", "1000", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt2}{2}", True),
    ("The answer is $\\frac{7}{2}$.", "3.5", True),
    ("\\boxed{3.50}", "3.5", True),
    ("\\boxed{007}", "7", True),
    ("\\boxed{-0}", "0", True),
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{\\text{Paris}}", "Paris", True),
    ("\\boxed{B}", "B", True),
    ("\\boxed{C}", "B", False),
    ("<answer>42</answer>", "42", True),
    ("The answer is 42</s>17", "42", True),
    ("\\boxed{\\$12.50}", "12.5", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{-\\frac{2}{3}}", "\\frac{-2}{3}", True),
    ("\\boxed{\\frac{2}{-3}}", "-2/3", True),
    ("\\boxed{1/0}", "1", False),
    ("\\boxed{9999999999999999999999}", "9999999999999999999999", True),
    ("\\boxed{9999999999999999999999}", "9999999999999999999998", False),
    ("\\boxed{10^{100000}}", "1", False),
    ("__import__('os').system('echo pwned')", "0", False),
    ("\\boxed{2x}", "2*x", True),
    ("\\boxed{2y}", "2x", False),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", True),
    ("\\boxed{1.5}", "\\frac32", True),
    ("NaN", "5", False),
    ("answer: 1/2", "\\frac{1}{2}", True),
    ("\\boxed{5}", "5 \\text{ meters}", True),
    ("\\boxed{\\frac{1}{2}x}", "x/2", True),
    (None, "5", False),
    ("\\boxed{1\\,000\\,000}", "10^6", True),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("so the result is \\boxed{3}.", "3", True),
    ("1000000", "1000001", False),
    ("so 10-3", "3", True),
    ("\\boxed{" + "(" * 60 + "1" + ")" * 60 + "}", "1", False),
    ("\\boxed{e^{\\ln 2}}", "2", True),
    ("\\boxed{\\sin^2 x + \\cos^2 x}", "1", True),
    ("\\boxed{100!}", "100!", True),
    ("\\boxed{10^{10^{10}}}", "1", False),
]
# issue 17: the misses of the hand-graded comparison with math-verify, and neighbours
TABLE_ISSUE17 = [
    # mixed numbers: 2 1/2 is 5/2, not 2 * 1/2
    ("\\boxed{2\\frac{1}{2}}", "\\frac{5}{2}", True),
    ("\\boxed{2\\frac{1}{2}}", "1", False),
    ("\\boxed{2 1/2}", "2.5", True),
    ("\\boxed{-3\\frac{3}{4}}", "-\\frac{15}{4}", True),  # -(3 + 3/4)
    ("\\boxed{3\\frac{1}{2}x}", "\\frac{3}{2}x", True),  # not a mixed number: 3 * x/2
    ("\\boxed{2\\frac{3}{2}}", "3", True),  # improper fraction: a product
    # intervals: bracket types count, half-open ones compare as intervals
    ("\\boxed{[2,5)}", "[2, 5)", True),
    ("\\boxed{[2,5)}", "[2,5]", False),
    ("\\boxed{(2,5)}", "[2,5]", False),
    ("\\boxed{(2,5]}", "(2,5)", False),
    ("\\boxed{\\left[ 2, 5 \\right)}", "[2,5)", True),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", True),
    ("\\boxed{[\\frac{1}{2}, 3)}", "[0.5, 3)", True),
    ("\\boxed{(-\\infty,1)\\cup(2,\\infty)}", "(2,\\infty) \\cup (-\\infty, 1)", True),
    ("\\boxed{(-\\infty,1]\\cup(2,\\infty)}", "(-\\infty,1)\\cup(2,\\infty)", False),
    ("\\boxed{(1, 2)}", "1, 2", True),
    # lists: in order unless the task says otherwise (see test_unordered_lists)
    ("\\boxed{3, 1, 2}", "1, 2, 3", False),
    ("\\boxed{x=1, x=2}", "1, 2", True),
    ("\\boxed{x = 2 \\text{ or } x = 3}", "2, 3", True),
    # tolerance: a decimal stands for what rounds to it
    ("\\boxed{1234567.5}", "1234567", False),
    ("\\boxed{1234567.0}", "1234567", True),
    ("\\boxed{0.3333333}", "1/3", True),
    ("\\boxed{3.1416}", "\\pi", False),
    ("\\boxed{2.50}", "2.5", True),
    ("\\boxed{0.1667}", "\\frac{1}{6}", False),
    # scientific notation (a math-verify miss)
    ("\\boxed{6.02e23}", "6.02\\times10^{23}", True),
    ("\\boxed{6.02 \\times 10^{23}}", "602000000000000000000000", True),
    ("\\boxed{6.02e23}", "6.03\\times10^{23}", False),
    # answers in words
    ("\\boxed{five}", "5", True),
    ("The answer is twenty-one.", "21", True),
    ("\\boxed{one hundred and five}", "105", True),
    ("\\boxed{one half}", "0.5", True),
    ("\\boxed{three quarters}", "\\frac34", True),
    ("\\boxed{minus two}", "-2", True),
    ("\\boxed{six}", "5", False),
    # several boxes: the last one is the answer (not a set of them: a math-verify miss)
    ("\\boxed{1} and \\boxed{2}", "2", True),
    ("\\boxed{1} and \\boxed{2}", "\\{1, 2\\}", False),
    ("\\boxed{2} wait, no: \\boxed{1}", "2", False),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), TABLE + TABLE_ISSUE17)
def test_verdict_table(completion: object, reference: str, expected: bool) -> None:
    assert verify_math(completion, reference) is expected


def test_unordered_lists() -> None:
    assert verify_math("\\boxed{3, 1, 2}", "1, 2, 3", unordered=True)
    assert verify_math("\\boxed{(3, 1, 2)}", "(1, 2, 3)", unordered=True)
    assert not verify_math("\\boxed{3, 1, 1}", "1, 2, 3", unordered=True)
    assert not verify_math("\\boxed{3, 1}", "1, 2, 3", unordered=True)
    assert not verify_math("\\boxed{[2, 5)}", "(5, 2]", unordered=True)  # intervals keep order
    assert math_answer("q", "\\boxed{2, 1}", {"answer": "1, 2", "answer_unordered": True}) == 1
    assert math_answer("q", "\\boxed{2, 1}", {"answer": "1, 2"}) == 0.0
    assert math_answer("q", "\\boxed{2, 1}", {"answer": "1, 2"}, unordered=True) == 1.0


def test_table_is_large_and_mixed() -> None:
    assert len(TABLE) >= 40 and len(TABLE_ISSUE17) >= 30
    assert sum(e for _, _, e in TABLE) >= 15 and sum(not e for _, _, e in TABLE) >= 15


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{a} then \\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("<answer> 12 </answer>", "12"),
        ("The final answer is: 7.", "7."),
        ("we get $x=3$ and the total is 12", "12"),
        ("the total is 12, i.e. $\\frac{24}{2}$", "\\frac{24}{2}"),
        ("no numbers here", None),
        ("", None),
        ("so 10-3", "3"),
        ("value -4.5 then", "-4.5"),
        ("1,234,567 apples", "1,234,567"),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


def test_parse_kinds() -> None:
    assert parse_answer("\\frac{1}{2}").kind == "number"
    assert parse_answer("0.25").approx
    assert parse_answer("2\\sqrt{2}").kind == "expr"
    assert parse_answer("(1, 2, 3)").kind == "tuple"
    assert parse_answer("(1, 2)").kind == "interval"  # a pair reads as an interval ...
    assert answers_equal("(1, 2)", "1, 2")  # ... that still equals the bare pair
    assert parse_answer("[1, 2)").kind == "interval"
    assert parse_answer("[1, 2) \\cup (3, 4]").kind == "union"
    assert parse_answer("seventy-two").value == 72
    assert parse_answer("\\{1, 2\\}").kind == "set"
    assert parse_answer("Paris").kind == "text"
    assert parse_answer("50\\%").percent


def test_registered_reward_fn() -> None:
    assert get_reward_fn("math") is math_answer
    assert math_answer("q", "\\boxed{4}", {"answer": "4"}) == 1.0
    assert math_answer("q", "\\boxed{4}", {"answer": 4}) == 1.0
    assert math_answer("q", "\\boxed{4}", {"answer": 4.0}) == 1.0
    assert math_answer("q", "\\boxed{4}", {}) == 0.0  # no answer field: 0, never raises
    assert math_answer("q", "\\boxed{4}", None) == 0.0  # type: ignore[arg-type]
    assert math_answer("q", "\\boxed{4}", {"answer": ["4"]}) == 0.0


def test_no_eval_of_model_output(tmp_path) -> None:
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    assert not verify_math(payload, "12345")
    assert not answers_equal(payload, payload.replace("x", "y"))
    assert not marker.exists()


@pytest.mark.parametrize(
    "evil",
    [
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
        "\\boxed{1" + "+1" * 20000 + "}",
        "\\boxed{" + "x" * 100000 + "}",
        "\\boxed{(10^{10})!}",
        "\\boxed{\\frac{1}{0}}",
        "1e999999999",
    ],
)
def test_adversarial_inputs_are_fast(evil: str) -> None:
    t0 = time.perf_counter()
    assert verify_math(evil, "1") is False
    assert time.perf_counter() - t0 < 2.0


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60), st.text(max_size=20))
def test_never_raises(completion: str, reference: str) -> None:
    assert verify_math(completion, reference) in (True, False)


@settings(max_examples=100, deadline=None)
@given(st.integers(-(10**12), 10**12), st.integers(1, 10**6))
def test_fractions_equal_decimals(num: int, den: int) -> None:
    from fractions import Fraction

    f = Fraction(num, den)
    assert verify_math(f"\\boxed{{\\frac{{{num}}}{{{den}}}}}", f"{f.numerator}/{f.denominator}")
    assert verify_math(f"The answer is {num}", str(num))

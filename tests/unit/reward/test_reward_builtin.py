"""Built-in reward functions: regex, format tags, DAPO overlong penalty, code extraction, and
the reason channel of ``evaluate``."""

from __future__ import annotations

import math

import pytest

from relayrl.reward import (
    REWARD_FUNCTIONS,
    RewardMix,
    evaluate,
    extract_code,
    format_tags,
    overlong_penalty,
    regex_match,
    score,
)


def test_builtins_are_registered() -> None:
    for name in ("arithmetic", "exact_match", "math", "regex", "format", "overlong", "code"):
        assert name in REWARD_FUNCTIONS


@pytest.mark.parametrize(
    ("completion", "pattern", "search", "expected"),
    [
        ("  42 ", r"\d+", False, 1.0),
        ("answer 42", r"\d+", False, 0.0),
        ("answer 42", r"\d+", True, 1.0),
        ("yes</s>", r"yes|no", False, 1.0),
        ("", r"\d+", False, 0.0),
    ],
)
def test_regex(completion: str, pattern: str, search: bool, expected: float) -> None:
    assert regex_match("q", completion, {}, pattern=pattern, search=search) == expected


def test_regex_from_sample_and_bad_patterns() -> None:
    assert regex_match("q", "B", {"answer_regex": "[AB]"}) == 1.0
    assert regex_match("q", "B", {"answer_regex": "("}) == 0.0  # bad data: 0, no crash
    assert regex_match("q", "B", {}) == 0.0
    import re

    with pytest.raises(re.error):  # bad configuration: the caller's error
        regex_match("q", "B", {}, pattern="(")


@pytest.mark.parametrize(
    ("completion", "strict", "expected"),
    [
        ("<think>hmm</think><answer>4</answer>", True, 1.0),
        ("  <think>a\nb</think>\n<answer>4</answer>\n", True, 1.0),
        ("<think>hmm</think><answer>4</answer><|im_end|>junk", True, 1.0),
        ("<answer>4</answer><think>hmm</think>", True, 0.0),  # wrong order
        ("<think>hmm</think>", True, 0.0),  # missing tag
        ("so <think>hmm</think> and <answer>4</answer>", True, 0.0),  # text outside
        ("so <think>hmm</think> and <answer>4</answer>", False, 1.0),
        ("<think><think>x</think></think><answer>4</answer>", True, 0.0),  # nested
        ("<think>a</think><think>b</think><answer>4</answer>", False, 0.0),  # twice
        ("", True, 0.0),
    ],
)
def test_format_tags(completion: str, strict: bool, expected: float) -> None:
    assert format_tags("q", completion, {}, strict=strict) == expected


def test_format_custom_tags() -> None:
    assert format_tags("q", "<reasoning>x</reasoning><code>y</code>", {}, ["reasoning", "code"])


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (17, -1.0), (100, -1.0)],
)
def test_overlong_penalty(length: int, expected: float) -> None:
    # L_max = 16, L_cache = 4: free up to 12, linear to -1 at 16, -1 beyond
    got = overlong_penalty("q", "", {"response_length": length}, max_length=16, cache_length=4)
    assert got == pytest.approx(expected)


def test_overlong_without_token_length_uses_characters() -> None:
    assert overlong_penalty("q", "x" * 14, {}, max_length=16, cache_length=4) == -0.5
    with pytest.raises(ValueError):
        overlong_penalty("q", "", {}, max_length=4, cache_length=8)


def test_extract_code() -> None:
    assert extract_code("```python\nx = 1\n```") == "x = 1"
    text = "first\n```\nplain\n```\nthen\n```py\nreal = 2\n```\n```bash\nls\n```"
    assert extract_code(text) == "real = 2"
    assert extract_code("```sh\nls\n```") == "ls"
    assert extract_code("print(1)") == "print(1)"
    assert extract_code("```python\nunterminated = 3") == "unterminated = 3"


def test_evaluate_returns_the_reason() -> None:
    def fn(p, c, s):
        return {"score": 0.0, "pass_frac": 0.5, "reason": "timeout"}

    assert evaluate(fn, "", "", {}) == ({"score": 0.0, "pass_frac": 0.5}, "timeout")
    assert score(fn, "", "", {}) == {"score": 0.0, "pass_frac": 0.5}
    with pytest.raises(ValueError, match="NaN"):
        evaluate(lambda p, c, s: math.nan, "", "", {})


def test_mix_of_builtins_logs_every_component() -> None:
    mix = RewardMix(
        [
            {"fn": "math", "weight": 1.0},
            {"fn": "format", "weight": 0.2},
            {"fn": "overlong", "weight": 0.5, "kwargs": {"max_length": 16, "cache_length": 4}},
        ]
    )
    r = mix(
        "q", "<think>t</think><answer>\\boxed{7}</answer>", {"answer": "7", "response_length": 14}
    )
    assert r.components == {"math": 1.0, "format": 1.0, "overlong": -0.5, "score": 0.95}
    assert r.score == pytest.approx(0.95) and r.outcome == 1.0 and r.error is None

"""extract_integer_answer / parse_int_answer: hand-computed cases and never-raise properties."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.reward import extract_integer_answer, parse_int_answer, strip_special_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("   ", None),
        ("abc", None),
        ("12", 12),
        (" 12abc", 12),
        ("\n\t 12\n", 12),
        ("-3", -3),
        ("  -3 apples", -3),
        ("answer is 7", 7),
        ("answer is -7.", -7),
        ("7 then 8", 7),  # starts with an integer: the first one wins
        ("first 7 then 8", 8),  # otherwise: the last one
        ("1e5", 1),
        ("12.5", 12),
        ("so 10-3", 3),  # '-' after a digit is an operator, not a sign
        ("x=-4", -4),
        ("--5", -5),
        ("-", None),
        ("a -", None),
        ("007", 7),
        ("8</s>", 8),
        ("8<|endoftext|>", 8),
        ("8<|im_end|>garbage 99", 8),
        ("the sum is 8</s>9", 8),
        ("<s>12", 12),
        ("<pad><pad>5<eos>", 5),
        ("answer<|reserved_special_token_5|>", None),  # digits inside special tokens ignored
        ("x<|endoftext|>5", None),  # nothing counts after the end of turn
        ("\u22124", -4),  # Unicode minus sign
        ("\u0663", None),  # Arabic-Indic digit three: only ASCII digits count
        ("ünïcødé ✓ 42 🎉", 42),
        ("💥", None),
        ("\x00\x01 3", 3),
        ("a" * 100_000 + "9", 9),
        ("5" + "a" * 100_000, 5),
        ("1" * 10_000, None),  # more digits than int() accepts: None, not a crash
        ("-" * 100_000, None),
        ("<" * 50_000 + "|" * 50_000, None),
    ],
)
def test_extract_integer_answer_cases(text: str, expected: int | None) -> None:
    assert extract_integer_answer(text) == expected


@pytest.mark.parametrize("junk", [None, 12, 3.5, b"12", ["12"], {"a": 1}, object()])
def test_extract_integer_answer_non_string_gives_none(junk: object) -> None:
    assert extract_integer_answer(junk) is None  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_extract_integer_answer_never_raises(text: str) -> None:
    result = extract_integer_answer(text)
    assert result is None or isinstance(result, int)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30), st.sampled_from(["", " ", "</s>", "\n"]))
def test_extract_integer_answer_reads_printed_integers(n: int, suffix: str) -> None:
    assert extract_integer_answer(f" {n}{suffix}") == n
    assert extract_integer_answer(f"the answer is {n}{suffix}") == n


def test_strip_special_tokens() -> None:
    assert strip_special_tokens("3<|eot_id|>4") == "3"
    assert strip_special_tokens("<s>3<pad>") == " 3 "


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (8, 8),
        (-3, -3),
        ("8", 8),
        (" -3 ", -3),
        ("+4", 4),
        ("8.0", 8),
        (8.0, 8),
        (8.5, None),
        ("8.5", None),
        ("", None),
        ("abc", None),
        ("1e3", None),
        (None, None),
        (True, None),
        (float("nan"), None),
        (float("inf"), None),
        ([8], None),
        ("9" * 10_000, None),
    ],
)
def test_parse_int_answer(value: object, expected: int | None) -> None:
    assert parse_int_answer(value) == expected

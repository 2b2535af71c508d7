"""The trusted half of the code harness: splitting asserts into probes, decoding what the
sandbox reports, and judging -- with forged, malformed and out-of-range channel data.

No sandbox runs here: the channel bytes are written by hand, as a hostile program could.
"""

from __future__ import annotations

import json

import pytest

from relayrl.reward import code_tests
from relayrl.reward.sandbox.code_harness import (
    Opaque,
    decode_value,
    harness_program,
    judge,
    plan_tests,
)


def _line(k: int, value: object = None, err: str | None = None) -> bytes:
    msg: dict = {"k": k}
    if err is not None:
        msg["err"] = err
    else:
        msg["v"] = value
    return (json.dumps(msg) + "\n").encode()


def _int(v: int) -> dict:
    return {"t": "int", "v": str(v)}


def test_probes_hold_no_expected_values() -> None:
    plans = plan_tests(
        [
            "assert add(1, 2) == 3",
            "assert abs(area(2.0) - 12.566) < 1e-3",
            "import math\nassert math.isclose(f(1), 0.5)",
            "assert sorted(Solution().pairs([3, 1])) == [(1, 3)]",
            "assert not is_prime(8)",
        ]
    )
    probes = [p for plan in plans for p in plan.probes]
    assert probes == ["add(1, 2)", "area(2.0)", "f(1)", "Solution().pairs([3, 1])", "is_prime(8)"]
    program = harness_program(plans)
    for secret in ("12.566", "0.5", "(1, 3)", "== 3"):
        assert secret not in program  # the sandbox never sees what is expected


def test_judging_happens_here_on_plain_values() -> None:
    plans = plan_tests(["assert add(1, 2) == 3", "assert abs(add(0.5, 0.5) - 1) < 1e-9"])
    ok = _line(0, _int(3)) + _line(1, {"t": "float", "v": "1.0"})
    assert judge(plans, ok) == ([True, True], [None, None])
    wrong = _line(0, _int(4)) + _line(1, {"t": "float", "v": "inf"})
    assert judge(plans, wrong) == (
        [False, False],
        ["test 0 failed: AssertionError", "test 1 failed: AssertionError"],
    )


@pytest.mark.parametrize(
    "channel",
    [
        b"",
        b"PASS 0\nPASS 1\n",
        b'{"pass": [0, 1], "score": 1.0}\n',
        _line(-1, _int(3)) + _line(2, _int(3)) + _line(99, _int(3)),  # out of range
        _line(0, {"t": "other", "type": "AlwaysEqual"}),  # a forged object: opaque
        _line(0, {"t": "int", "v": "three"}),  # malformed
        _line(0, {"t": "bool", "v": True}),  # True == 3 is False here
        b"\xff\xfe garbage\n" + _line(0, {"t": "list", "v": [{"t": "deep"}] * 3}),
    ],
    ids=["nothing", "markers", "verdict", "range", "opaque", "malformed", "bool", "garbage"],
)
def test_forged_channels_pass_nothing(channel: bytes) -> None:
    plans = plan_tests(["assert add(1, 2) == 3"])
    passed, reasons = judge(plans, channel)
    assert passed == [False] and reasons[0] is not None


def test_first_report_of_a_probe_counts_and_load_errors_fail_everything() -> None:
    plans = plan_tests(["assert f(1) == 1", "assert f(2) == 2"])
    assert judge(plans, _line(0, _int(5)) + _line(0, _int(1)) + _line(1, _int(2)))[0] == [
        False,
        True,
    ]
    assert judge(plans, _line(0, err="ZeroDivisionError")) == (
        [False, False],
        ["test 0 failed: ZeroDivisionError", "test 1 did not complete"],
    )
    assert (
        judge(plans, b'{"load": "SyntaxError"}\n')[1]
        == ["solution failed to load: SyntaxError"] * 2
    )


def test_opaque_equals_nothing_and_is_false() -> None:
    o = Opaque("Eq")
    assert not (o == o) and o != 3 and not bool(o) and repr(o) == "<opaque Eq>"
    assert decode_value({"t": "set", "v": [_int(1), _int(2)]}) == {1, 2}
    assert decode_value({"t": "dict", "v": [[{"t": "str", "v": "a"}, _int(1)]]}) == {"a": 1}
    assert decode_value({"t": "tuple", "v": [{"t": "none"}, {"t": "bytes", "v": "6869"}]}) == (
        None,
        b"hi",
    )
    assert isinstance(decode_value({"t": "set", "v": [{"t": "list", "v": []}]}), Opaque)
    assert isinstance(decode_value("not a dict"), Opaque)


@pytest.mark.parametrize(
    ("test", "reason"),
    [
        (
            "assert all(f(i) == i for i in range(3))",
            "test 0 is not supported by the harness: solution names inside a comprehension "
            "or lambda cannot be probed",
        ),
        (
            "x = f(1)\nassert x == 1",
            "test 0 is not supported by the harness: line 1: Assign statement (only assert "
            "statements and imports are allowed)",
        ),
        (
            "import os\nassert f(1) == 1",
            "test 0 is not supported by the harness: line 1: import of 'os' (only math, "
            "cmath, string may be imported)",
        ),
        ("assert f(1 ==", "test 0 is not valid Python: '(' was never closed (line 1)"),
    ],
    ids=["comprehension", "assignment", "import", "syntax"],
)
def test_unsupported_tests_fail_with_a_reason(test: str, reason: str) -> None:
    plans = plan_tests([test])
    assert judge(plans, _line(0, {"t": "bool", "v": True})) == ([False], [reason])


def test_partial_credit_is_a_fraction_in_range() -> None:
    sample = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    out = code_tests("", "def add(a, b):\n    return a + b", sample, partial_credit=True)
    assert out == {"score": 0.5, "tests_passed": 0.5, "reason": "test 1 failed: AssertionError"}

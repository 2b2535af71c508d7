"""Built-in reward functions, registered by name on import.

==================  ===============================================================
name                what it scores
==================  ===============================================================
``math``            1.0 if the completion's final answer equals ``sample['answer']``
                    (``\\boxed{}`` or last number; compared symbolically and
                    numerically, see ``relayrl.reward.math.answer``), else 0.0
``regex``           1.0 if the stripped completion fully matches a pattern
                    (``pattern=`` keyword, else ``sample['answer_regex']``)
``format``          1.0 if the completion is made of the required tag blocks in
                    order (default ``<think>...</think><answer>...</answer>``)
``overlong``        DAPO's soft overlong penalty on the response length in tokens
``code``            runs the completion's Python code against the sample's unit
                    tests in the sandbox; 1.0 when all pass
==================  ===============================================================

(``arithmetic`` and ``exact_match`` live in ``relayrl.reward.functions``.) Keyword arguments
come from the reward spec (``{fn: overlong, kwargs: {max_length: 512, cache_length: 128}}``).
All of them return 0.0 for a malformed sample rather than raising, except for a bad keyword
configuration, which is the caller's error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from relayrl.reward.functions import register_reward_fn
from relayrl.reward.math.answer import verify_math
from relayrl.reward.sandbox import Sandbox, SandboxLimits, SandboxResult
from relayrl.reward.sandbox.code_harness import harness_program, judge, plan_tests
from relayrl.reward.verifiers import strip_special_tokens


class SandboxUnavailable(RuntimeError):
    """The sandbox itself could not start a program, or was killed from outside while it ran
    (not the program's fault): an infrastructure failure, never a score of 0
    (``relayrl.controller.failures``)."""


def _started(result: SandboxResult) -> SandboxResult:
    if result.status == "sandbox_error":
        raise SandboxUnavailable(f"the sandbox could not run the program: {result.reason}")
    return result


__all__ = [
    "code_tests",
    "extract_code",
    "format_tags",
    "math_answer",
    "overlong_penalty",
    "regex_match",
]


def _field(sample: Any, key: str) -> Any:
    return sample.get(key) if isinstance(sample, dict) else None


@register_reward_fn("math")
def math_answer(prompt: str, completion: str, sample: dict, unordered: bool | None = None) -> float:
    """1.0 if the final answer of ``completion`` equals ``sample['answer']``, else 0.0.

    ``unordered`` (default: ``sample['answer_unordered']``, else False): a list answer is
    right in any order."""
    if unordered is None:
        unordered = _field(sample, "answer_unordered") is True
    return 1.0 if verify_math(completion, _field(sample, "answer"), bool(unordered)) else 0.0


@register_reward_fn("regex")
def regex_match(
    prompt: str, completion: str, sample: dict, pattern: str | None = None, search: bool = False
) -> float:
    """1.0 if ``completion.strip()`` matches the pattern (full match, or anywhere with
    ``search=True``). The pattern is the ``pattern`` keyword, else ``sample['answer_regex']``;
    none, or an invalid one in the sample, gives 0.0."""
    pat = pattern if pattern is not None else _field(sample, "answer_regex")
    if not isinstance(pat, str) or not isinstance(completion, str):
        return 0.0
    try:
        rx = re.compile(pat, re.S)
    except re.error:
        if pattern is not None:
            raise
        return 0.0
    text = strip_special_tokens(completion).strip()
    found = rx.search(text) if search else rx.fullmatch(text)
    return 1.0 if found else 0.0


def _tags_regex(tags: Sequence[str]) -> re.Pattern[str]:
    parts = [rf"<{re.escape(t)}>(?:(?!</?{re.escape(t)}>).)*?</{re.escape(t)}>" for t in tags]
    return re.compile(r"\s*" + r"\s*".join(parts) + r"\s*", re.S)


@register_reward_fn("format")
def format_tags(
    prompt: str,
    completion: str,
    sample: dict,
    tags: Sequence[str] = ("think", "answer"),
    strict: bool = True,
) -> float:
    """1.0 if the completion holds each ``<tag>...</tag>`` block once, in order.

    ``strict`` (default): nothing but whitespace outside the blocks (R1's format reward);
    otherwise the blocks may sit anywhere in the text. Tags must not nest in themselves.
    """
    if not isinstance(completion, str) or not tags:
        return 0.0
    text = strip_special_tokens(completion)
    rx = _tags_regex(list(tags))
    if strict:
        return 1.0 if rx.fullmatch(text) else 0.0
    if not rx.pattern:
        return 0.0
    loose = re.compile(rx.pattern.replace(r"\s*", r".*?"), re.S)
    counts_ok = all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in tags)
    return 1.0 if counts_ok and loose.search(text) else 0.0


@register_reward_fn("overlong")
def overlong_penalty(
    prompt: str, completion: str, sample: dict, max_length: int, cache_length: int
) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L = response length in tokens:

    R = 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache if L <= L_max; else -1.

    ``max_length`` = L_max, ``cache_length`` = L_cache. L is ``sample['response_length']``
    (set by the reward service); without it, the completion's length in characters.
    """
    if not (isinstance(max_length, int) and isinstance(cache_length, int)):
        raise TypeError("overlong: max_length and cache_length must be ints")
    if not 0 < cache_length <= max_length:
        raise ValueError("overlong: need 0 < cache_length <= max_length")
    length = _field(sample, "response_length")
    if not isinstance(length, int) or isinstance(length, bool):
        length = len(completion) if isinstance(completion, str) else 0
    start = max_length - cache_length
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / cache_length
    return -1.0


# ---------------------------------------------------------------------------------------------
# code execution

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|$)", re.S)


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block tagged python/py (else the last
    fenced block of any language); without fences, the whole text."""
    if not isinstance(completion, str):
        return ""
    text = strip_special_tokens(completion)
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return text.strip("\n")
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [body for _, body in blocks])[-1].strip("\n")


def _run_assert_tests(box: Sandbox, source: str, tests: list[str]) -> tuple[int, str | None]:
    """(number of tests passed, reason of the first failure) for assert-style tests, in one
    sandboxed run. The sandbox only evaluates the probes of each test and sends back their
    values; every comparison is made here (see ``relayrl.reward.sandbox.code_harness``)."""
    plans = plan_tests(tests)
    result = _started(
        box.run(
            harness_program(plans),
            files={"solution.py": source},
            channel=True,
            capture_bytes=4096,
            output_limit=False,  # stdout decides nothing: a chatty correct program still passes
        )
    )
    verdicts, reasons = judge(plans, result.channel)
    passed = sum(1 for ok in verdicts[: len(tests)] if ok is True)
    first_fail = next((r for r in reasons if r is not None), None)
    if passed < len(tests) and result.status not in ("ok", "error") and result.reason:
        first_fail = result.reason  # timeout, memory, ... explain more than the tests do
    return min(passed, len(tests)), first_fail


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _run_io_tests(box: Sandbox, source: str, cases: list[dict]) -> tuple[int, str | None]:
    passed = 0
    first_fail: str | None = None
    for i, case in enumerate(cases):
        expected = str(case.get("output", ""))
        keep = max(65536, 4 * len(expected.encode("utf-8")) + 4096)
        result: SandboxResult = _started(
            box.run(
                source, stdin=str(case.get("input", "")), capture_bytes=keep, output_limit=False
            )
        )
        ok = (
            result.ok
            and result.stdout_bytes <= keep  # all of it kept: compared, never cut short
            and _normalize_output(result.stdout) == _normalize_output(expected)
        )
        if ok:
            passed += 1
        elif first_fail is None:
            first_fail = f"case {i}: " + (result.reason or "wrong output")
    return passed, first_fail


@register_reward_fn("code")
def code_tests(
    prompt: str,
    completion: str,
    sample: dict,
    partial_credit: bool = False,
    cpu_s: float = 5.0,
    wall_s: float = 10.0,
    memory_mb: int = 512,
    isolation: str = "auto",
) -> dict[str, Any]:
    """Run the completion's code (``extract_code``) against the sample's tests, sandboxed.

    Tests: ``sample['tests']`` (assert statements: a list of strings, or one string run as a
    single test) and/or ``sample['test_cases']`` (``{"input": stdin, "output": stdout}``
    pairs, one sandboxed run each, output compared line by line without trailing spaces).

    Returns ``{"score": 1.0 if all pass else 0.0 (the pass fraction with partial_credit),
    "tests_passed": fraction, "reason": why the first failure failed}``. No tests gives 0.0
    with a reason.
    """
    tests = _field(sample, "tests")
    if isinstance(tests, str):
        tests = [tests]
    cases = _field(sample, "test_cases")
    tests = [t for t in tests if isinstance(t, str)] if isinstance(tests, list) else []
    cases = [c for c in cases if isinstance(c, dict)] if isinstance(cases, list) else []
    total = len(tests) + len(cases)
    if total == 0:
        return {"score": 0.0, "tests_passed": 0.0, "reason": "sample has no tests"}
    source = extract_code(completion)
    if not source.strip():
        return {"score": 0.0, "tests_passed": 0.0, "reason": "no code in the completion"}
    limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    box = Sandbox(limits, isolation=isolation)  # type: ignore[arg-type]
    passed, reason = 0, None
    try:
        if tests:
            n, reason = _run_assert_tests(box, source, tests)
            passed += n
        if cases:
            n, r = _run_io_tests(box, source, cases)
            passed += n
            reason = reason or r
    except OSError as e:  # no temporary directory, no interpreter, ...: not the program's
        raise SandboxUnavailable(f"the sandbox could not start the program: {e}") from e
    frac = min(1.0, max(0.0, passed / total))
    return {
        "score": frac if partial_credit else float(passed == total),
        "tests_passed": frac,
        "reason": None if passed == total else reason,
    }

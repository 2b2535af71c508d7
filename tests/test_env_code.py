"""The multi-turn code environment (relayrl.env.builtin.code): task rows, feedback, real
sandboxed test runs."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.env.builtin.code import (
    CodeEnv,
    code_task_rows,
    failure_feedback,
    sft_traces,
)
from relayrl.env.types import EnvError


def test_rows_are_reproducible_and_solved_by_their_answer():
    rows = code_task_rows(50, seed=3)
    assert rows == code_task_rows(50, seed=3)
    assert rows != code_task_rows(50, seed=4)
    for r in rows:
        ns: dict = {}
        exec(r["answer"], ns)  # noqa: S102  (our own reference solutions)
        for t in r["tests"]:
            exec(t, ns)  # noqa: S102
        assert len(r["tests"]) == 3
    with pytest.raises(ValueError, match="families"):
        code_task_rows(1, families=("div",))


def test_failure_feedback_names_the_failed_call():
    tests = ["assert f(2) == 5", "assert f(4) == 7", "assert f(12) == 15"]
    assert failure_feedback(tests, "test 2 failed: AssertionError") == "f(12) must be 15"
    assert failure_feedback(tests, "test 0 failed") == "f(2) must be 5"
    assert failure_feedback(tests, "solution failed to load: SyntaxError") == "error: SyntaxError"
    assert failure_feedback(tests, None) == "error: wrong answer"


def test_sft_traces_plain_rendering():
    rows = [
        {
            "prompt": "f(2)=5 f(4)=7",
            "answer": "def f(x):return x+3",
            "tests": ["assert f(2) == 5", "assert f(4) == 7", "assert f(11) == 14"],
        }
    ]
    one = sft_traces(rows, "<eos>", repair_fraction=0.0)[0]
    assert one == {"prompt": "U:f(2)=5 f(4)=7\nA:", "response": "def f(x):return x+3"}
    rep = sft_traces(rows, "<eos>", repair_fraction=1.0)[0]
    assert rep["response"] == "def f(x):return x+4<eos>U:f(2) must be 5\nA:def f(x):return x+3"


def test_code_env_runs_the_tests_in_the_sandbox():
    row = {
        "prompt": "f(2)=5 f(4)=7",
        "tests": ["assert f(2) == 5", "assert f(4) == 7", "assert f(11) == 14"],
    }

    async def episode():
        env = CodeEnv()
        first = await env.reset(row)
        wrong = await env.step({"role": "assistant", "content": "def f(x):return x+2"})
        broken = await env.step({"role": "assistant", "content": "def f(x) return"})
        right = await env.step({"role": "assistant", "content": "def f(x):return x+3"})
        await env.close()
        return first, wrong, broken, right

    first, wrong, broken, right = asyncio.run(episode())
    assert first == [{"role": "user", "content": "f(2)=5 f(4)=7"}]
    assert not wrong.done and wrong.reward == 0.0
    assert wrong.observation == [{"role": "user", "content": "f(2) must be 5"}]
    assert broken.observation[0]["content"].startswith("error: SyntaxError")
    assert right.done and right.reward == 1.0 and right.info["tests_passed"] == 1.0


def test_code_env_rejects_a_row_without_tests():
    with pytest.raises(EnvError, match="tests"):
        asyncio.run(CodeEnv().reset({"prompt": "x"}))

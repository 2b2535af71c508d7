"""The multi-turn code environment: the model writes a function, the environment runs the tests
in the code sandbox and returns the first failure, up to ``env.max_turns`` turns.

Each turn the assistant's message is a program (``relayrl.reward.builtin.extract_code``: the
last fenced block, else the whole text); the environment runs it against the row's assert
tests with the code reward (``relayrl.reward.builtin.code_tests``: the sandbox evaluates only
the probes, the verdict is decided in this process, out of the program's reach). All tests
pass: the episode is done with reward 1. Otherwise the observation is one ``user`` message
naming the first failure, and the model tries again::

    U:f(2)=5 f(4)=7
    A:def f(x):return x+2<eos>U:f(10) must be 13
    A:def f(x):return x+3<eos>                         (done, reward 1)

A program that does not load gets ``error: <reason>`` (e.g. ``error: SyntaxError``). The
sandbox runs in a worker thread (``asyncio.to_thread``), so the engine serves other episodes
meanwhile.

The shipped task (``code_task_rows``) is a family a tiny model can learn: ``f(x) = x + k`` or
``f(x) = x * k`` from two visible examples, checked on those and a hidden third input.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.env.environment import Environment
from relayrl.env.types import EnvError, Message, StepResult
from relayrl.reward.builtin import code_tests

_TEST_RE = re.compile(r"^assert (?P<call>.+?) == (?P<want>.+)$")
_FAILED_RE = re.compile(r"^test (?P<i>\d+) failed")

FAMILIES = ("add", "mul")


def _make_row(rng: random.Random, families: Sequence[str]) -> dict[str, Any]:
    fam = rng.choice(list(families))
    k = rng.randint(1, 9) if fam == "add" else rng.randint(2, 9)
    xs = rng.sample(range(1, 10), 2)
    hidden = rng.randint(10, 20)

    def f(x: int) -> int:
        return x + k if fam == "add" else x * k

    op = "+" if fam == "add" else "*"
    prompt = " ".join(f"f({x})={f(x)}" for x in xs)
    tests = [f"assert f({x}) == {f(x)}" for x in (*xs, hidden)]
    return {"prompt": prompt, "answer": f"def f(x):return x{op}{k}", "tests": tests}


def code_task_rows(n: int, seed: int = 0, families: Sequence[str] = FAMILIES) -> list[dict]:
    """``n`` rows ``{"prompt", "answer" (a reference solution), "tests"}`` of the shipped task
    (see module), reproducible from ``seed``; JSONL-ready for ``data.task: jsonl``."""
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        raise ValueError(f"code_task_rows: families must be a non-empty subset of {FAMILIES}")
    rng = random.Random(seed)
    return [_make_row(rng, families) for _ in range(n)]


def failure_feedback(tests: Sequence[str], reason: str | None) -> str:
    """The observation after a failed turn: ``CALL must be WANT`` for a failed assert test
    (``f(10) must be 13``), else ``error: REASON`` (the program did not load or run)."""
    m = _FAILED_RE.match(reason or "")
    if m and int(m["i"]) < len(tests):
        t = _TEST_RE.match(tests[int(m["i"])].strip())
        if t:
            return f"{t['call']} must be {t['want']}"
        return f"failed: {tests[int(m['i'])]}"
    short = (reason or "wrong answer").removeprefix("solution failed to load: ")
    return f"error: {short}"[:80]


class CodeEnv(Environment):
    """Write a function; tests run in the sandbox; the first failure is the observation.

    Args:
        cpu_s, wall_s, memory_mb: the sandbox limits of one test run.
        isolation: the sandbox's isolation mode (``auto`` probes bubblewrap first).
        feedback: ``False`` returns a bare ``try again`` (an ablation: what the failure
            message is worth).
    """

    def __init__(
        self,
        cpu_s: float = 2.0,
        wall_s: float = 5.0,
        memory_mb: int = 256,
        isolation: str = "auto",
        feedback: bool = True,
    ):
        self._score = functools.partial(  # code_tests with the sandbox limits of one run
            code_tests, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, isolation=isolation
        )
        self.feedback = feedback
        self.tests: list[str] = []
        self.runs = 0

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        tests = row.get("tests")
        if isinstance(tests, str):
            tests = [tests]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise EnvError("code env: the row has no 'tests' (a list of assert statements)")
        self.tests = list(tests)
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, message: Message) -> StepResult:
        text = message.get("content", "")
        result = await asyncio.to_thread(self._score, "", text, {"tests": self.tests})
        self.runs += 1
        info = {"tests_passed": result["tests_passed"], "reason": result["reason"]}
        if result["score"] >= 1.0:
            return StepResult(done=True, reward=1.0, info=info)
        note = failure_feedback(self.tests, result["reason"]) if self.feedback else "try again"
        return StepResult([{"role": "user", "content": note}], reward=0.0, info=info)


def make_code_env(**kwargs: Any) -> CodeEnv:
    """``env.factory: code`` (``env.kwargs`` are ``CodeEnv``'s arguments)."""
    return CodeEnv(**kwargs)


def sft_traces(
    rows: Sequence[Mapping[str, Any]],
    eos: str,
    repair_fraction: float = 0.3,
    seed: int = 0,
) -> list[dict[str, str]]:
    """Synthetic SFT traces (``prompt`` / ``response`` records for ``relayrl sft``) in the
    plain rendering (``relayrl.env.render.PlainRenderer``): the correct function in one turn,
    or, for ``repair_fraction`` of the rows, a wrong first attempt (the constant off by one,
    so test 0 fails), the environment's failure message and the corrected function (a repair
    trace: what makes a later turn worth having). The observation inside a repair trace is
    trained on too (a warm-start fixture; the RL run masks observations)."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = str(row["answer"])
        prompt = f"U:{row['prompt']}\nA:"
        if rng.random() < repair_fraction:
            k = int(answer[-1])
            wrong = answer[:-1] + str(k + 1 if k < 9 else k - 1)
            note = failure_feedback(row["tests"], "test 0 failed")  # what the env would say
            response = f"{wrong}{eos}U:{note}\nA:{answer}"
        else:
            response = answer
        out.append({"prompt": prompt, "response": response})
    return out

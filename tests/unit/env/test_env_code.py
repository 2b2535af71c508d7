"""The multi-turn code environment (relayrl.env.builtin.code): task rows, feedback, real
sandboxed test runs."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers import load_bench, run_config
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.env.builtin.code import (
    CodeEnv,
    code_task_rows,
    failure_feedback,
    sft_traces,
)
from relayrl.env.types import EnvError
from relayrl.model import build_tiny_model


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


def _write_rows(path, n, seed):
    path.write_text("".join(json.dumps(r) + "\n" for r in code_task_rows(n, seed=seed)))
    return path


def test_grpo_over_the_code_env_runs_end_to_end(tmp_path):
    """Multi-turn GRPO on the code environment through the trainer: every episode is scored by
    the sandboxed tests (the env's outcome), failures come back as observations, nothing
    fails as infrastructure."""
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=2)
    cfg = run_config(
        model,
        tmp_path / "run",
        "data.task=jsonl",
        f"data.train_path={_write_rows(tmp_path / 'train.jsonl', 32, 0)}",
        f"data.eval_path={_write_rows(tmp_path / 'eval.jsonl', 4, 1)}",
        "reward.fn=code",
        "env.factory=code",
        "env.outcome=env",
        "env.max_turns=2",
        "rollout.max_tokens=16",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.steps=2",
        "train.save_every=0",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "env/episodes" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes"] == 4
        assert r.get("env/failures", 0) == 0
        assert sum(v for k, v in r.items() if k.startswith("env/stop_")) == 4
        assert 1 <= r["env/turns_mean"] <= 2


@pytest.mark.slow
@pytest.mark.learning
def test_pass_rate_rises_with_allowed_turns_on_a_fixed_model(tmp_path):
    """One SFT'd tiny model (bench/code_env_turns.py: 400 SFT steps on one-turn and repair
    traces), 64 held-out episodes at temperature 1, the same seeds for every K: the pass rate
    within 2 turns beats 1 turn. Measured (seed 0, AMD EPYC AVX-512): 0.44 at K=1, 0.59 at
    K=2, 0.59 at K=3 and 4; the margin asserted is a quarter of that gain."""
    bench = load_bench("code_env_turns")
    model = bench.sft_code_model(tmp_path, steps=400, seed=0)
    one = bench.pass_rate(model, 1, 64)
    two = bench.pass_rate(model, 2, 64)
    assert one["failures"] == two["failures"] == 0
    assert 0.05 < one["pass_rate"] < 0.95  # the model solves some, not all, in one turn
    assert two["pass_rate"] >= one["pass_rate"] + 0.04
    assert two["turns_mean"] > 1.0

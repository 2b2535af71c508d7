"""``relayrl eval`` with ``env.factory``: evaluation runs episodes through the environment
runner (as the evaluation inside training does), and pass@k counts the environments' rewards.

The environment below ignores what the model says: it answers every first turn with a tool
message, ends the episode on the second turn, and rewards 1 when the row's answer is even
(``env.outcome: env``). Whatever the (untrained) tiny model writes, the pass rate is then the
share of held-out prompts whose answer is even, and every answer holds two assistant turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from relayrl.cli import main
from relayrl.env.environment import Environment
from relayrl.env.types import Message, StepResult
from relayrl.model import build_tiny_model


class ParityEnv(Environment):
    steps = 0  # every step of every instance (the eval runs in this process)

    def __init__(self) -> None:
        self.turn = 0
        self.even = False

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.turn = 0
        self.even = int(row["answer"]) % 2 == 0
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, message: Message) -> StepResult:
        ParityEnv.steps += 1
        self.turn += 1
        if self.turn < 2:
            return StepResult([{"role": "tool", "content": "ok"}])
        return StepResult(done=True, reward=1.0 if self.even else 0.0)


def make_parity_env() -> ParityEnv:
    return ParityEnv()


def test_relayrl_eval_runs_episodes_through_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=0)
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(
        f"model:\n  path: {model}\nrun_dir: {tmp_path / 'run'}\nthreads: 1\n"
        "rollout:\n  max_tokens: 4\ndata:\n  eval_size: 10\neval:\n  seed: 0\n"
        "env:\n  factory: test_eval_env:make_parity_env\n  outcome: env\n  max_turns: 3\n"
    )
    out = tmp_path / "answers.jsonl"
    ParityEnv.steps = 0
    assert main(["eval", str(cfg), "--n", "2", "--k", "1", "--k", "2", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20
    assert ParityEnv.steps == 2 * 20  # two turns per episode, each stepped by the env
    even = [int(r["reference"]) % 2 == 0 for r in rows[::2]]
    assert 0 < sum(even) < len(even)  # both kinds of prompt: the pass rate can be wrong
    for r in rows:
        assert r["correct"] == (int(r["reference"]) % 2 == 0)
        assert r["outcome"] == (1.0 if r["correct"] else 0.0)
    summary = json.loads(out.with_suffix(".summary.json").read_text())["held-out"]
    share = sum(even) / len(even)
    # both answers of a prompt share its outcome: pass@1 = pass@2 = the share of even answers
    assert summary["pass@1"] == pytest.approx(share)
    assert summary["pass@2"] == pytest.approx(share)
    assert summary["pass_rate"] == pytest.approx(share)
    assert "pass@2" in capsys.readouterr().out

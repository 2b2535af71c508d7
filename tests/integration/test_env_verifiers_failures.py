"""``verifiers`` environments that fail: an infrastructure failure is a failed rollout
(``env_error``, left out of training), never a zero reward. verifiers' ``Rubric`` catches a
reward function's exception and scores it 0.0 (logging it); through relayrl's adapter the
rollout fails instead, as a raising ``reward.fn`` does (docs/failures.md, ``reward_fn``)."""

from __future__ import annotations

import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env.agent_rollout import AgentRollout
from relayrl.env.verifiers_adapter import verifiers_agent
from relayrl.rollout import GenerationRequest, SamplingParams

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")


def _dataset():
    return datasets.Dataset.from_list([{"question": "12*34?", "answer": "408"}])


def correct(completion, answer, **kwargs) -> float:
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if (last.get("content") or "").strip() == answer else 0.0


def judge_down(completion, answer, **kwargs) -> float:
    raise ConnectionError("the judge model's endpoint refused the connection")


async def async_judge_down(completion, **kwargs) -> float:
    raise TimeoutError("the judge did not answer")


def _run(env, replies, rows):
    tok = qwen_tokenizer()
    rollout = AgentRollout(ScriptedEngine(tok, replies), tok, verifiers_agent(env), timeout_s=60)
    reqs = [
        GenerationRequest([1], SamplingParams(max_tokens=100, seed=i), group_id=0, metadata=r)
        for i, r in enumerate(rows)
    ]
    try:
        return rollout.generate(reqs)
    finally:
        rollout.close()


def _failed(sample) -> bool:
    info = sample.metadata["env"]
    return info["stop_reason"] == "env_error" and not any(sample.loss_mask)


@pytest.mark.parametrize("broken", [judge_down, async_judge_down])
def test_a_reward_function_that_raises_fails_the_rollout(broken):
    """Two rubrics (a RubricGroup): the working one would give 1.0, the broken one raises:
    verifiers alone scores the rollout 1.0 + 0.0; relayrl fails it, naming the function."""
    rubric = vf.RubricGroup([vf.Rubric(funcs=[correct]), vf.Rubric(funcs=[broken])])
    env = vf.SingleTurnEnv(dataset=_dataset(), rubric=rubric)
    (sample,) = _run(env, ["408"], [{"prompt": "12*34?", "answer": "408"}])
    assert _failed(sample), sample.metadata["env"]
    error = sample.metadata["env"]["error"]
    assert broken.__name__ in error and "raised" in error


def test_a_working_rubric_still_scores_and_zero_is_a_reward():
    env = vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[correct]))
    rows = [{"prompt": "12*34?", "answer": "408"}, {"prompt": "12*34?", "answer": "407"}]
    samples = _run(env, ["408"], rows)
    assert [s.metadata["env"]["outcome"] for s in samples] == [1.0, 0.0]
    assert all(s.metadata["env"]["error"] is None for s in samples)


class BrokenEnv(vf.MultiTurnEnv):
    """Its environment turn fails (a backend it needs is gone)."""

    async def is_completed(self, messages, state, **kwargs) -> bool:
        return state.get("turn", 0) >= 2

    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the game server went away")


def test_an_environment_turn_that_raises_fails_the_rollout():
    env = BrokenEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[correct]), max_turns=3)
    (sample,) = _run(env, ["408", "409"], [{"prompt": "12*34?", "answer": "408"}])
    assert _failed(sample)
    assert "the game server went away" in sample.metadata["env"]["error"]


TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
tool_calls: list[str] = []


def lookup(key: str) -> str:
    """Look a key up in the store.

    Args:
        key: the key
    """
    tool_calls.append(key)
    if key == "x":
        from relayrl.env.types import EnvError

        raise EnvError("the key-value store is unreachable")
    return "value"


async def async_lookup(key: str) -> str:
    """Look a key up in the store.

    Args:
        key: the key
    """
    return lookup(key)


async def model_mistake(key: str) -> str:
    """Look a key up in the store.

    Args:
        key: the key
    """
    raise KeyError(key)


@pytest.mark.parametrize("tool", [lookup, async_lookup])
def test_a_tool_that_raises_env_error_fails_the_rollout(tool):
    """verifiers' ``ToolEnv.call_tool`` catches every exception and shows it to the model, so
    the model would train on its backend being down; ``EnvError`` (relayrl's infrastructure
    failure, docs/failures.md) fails the rollout at once, as with relayrl's own tools."""
    tool_calls.clear()
    env = vf.ToolEnv(
        tools=[tool], dataset=_dataset(), max_turns=4, rubric=vf.Rubric(funcs=[correct])
    )
    call = TOOL_CALL.replace("lookup", tool.__name__)
    (sample,) = _run(env, [call, "408"], [{"prompt": "12*34?", "answer": "408"}])
    assert _failed(sample), sample.metadata["env"]
    assert "the key-value store is unreachable" in sample.metadata["env"]["error"]
    assert tool_calls == ["x"]
    assert sample.metadata["env"]["turns"] == 1  # ended at the failing call, no second turn


def test_a_tool_that_raises_anything_else_is_shown_to_the_model_and_trains():
    env = vf.ToolEnv(
        tools=[model_mistake], dataset=_dataset(), max_turns=4, rubric=vf.Rubric(funcs=[correct])
    )
    tok = qwen_tokenizer()
    call = TOOL_CALL.replace("lookup", "model_mistake")
    rollout = AgentRollout(ScriptedEngine(tok, [call, "408"]), tok, verifiers_agent(env), 60)
    req = GenerationRequest(
        [1],
        SamplingParams(max_tokens=100, seed=0),
        group_id=0,
        metadata={"prompt": "12*34?", "answer": "408"},
    )
    try:
        (sample,) = rollout.generate([req])
    finally:
        rollout.close()
    info = sample.metadata["env"]
    assert info["error"] is None and info["outcome"] == 1.0 and info["turns"] == 2
    assert "<tool_response>\n'x'\n</tool_response>" in tok.decode(
        sample.prompt_ids + sample.response_ids
    )

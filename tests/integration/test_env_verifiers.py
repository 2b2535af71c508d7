"""``verifiers`` environments (the real PyPI package) run unchanged through relayrl: a
``ToolEnv`` with a Python tool and a rubric, and a ``SingleTurnEnv``, as agent rollouts on the
endpoint (Qwen2.5 template, scripted replies): the tool is called with the model's arguments,
the rubric's reward is the rollout's outcome, the trained tokens are the engine's."""

from __future__ import annotations

import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env.agent_rollout import AgentRollout
from relayrl.env.verifiers_adapter import verifiers_agent
from relayrl.rollout import GenerationRequest, SamplingParams

vf = pytest.importorskip("verifiers")
datasets = pytest.importorskip("datasets")

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
called: list[tuple[int, int]] = []


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    called.append((a, b))
    return a * b


def correct(completion, answer, **kwargs) -> float:
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if (last.get("content") or "").strip() == answer else 0.0


def _dataset():
    return datasets.Dataset.from_list([{"question": "12*34?", "answer": "408"}])


def _run(env, replies, rows):
    tok = qwen_tokenizer()
    rollout = AgentRollout(ScriptedEngine(tok, replies), tok, verifiers_agent(env), timeout_s=60)
    reqs = [
        GenerationRequest([1], SamplingParams(max_tokens=100, seed=i), group_id=0, metadata=r)
        for i, r in enumerate(rows)
    ]
    try:
        return tok, rollout.generate(reqs)
    finally:
        rollout.close()


def test_a_verifiers_tool_env_runs_unchanged():
    called.clear()
    env = vf.ToolEnv(
        tools=[multiply],
        dataset=_dataset(),
        max_turns=4,
        system_prompt="Use the tool.",
        rubric=vf.Rubric(funcs=[correct]),
    )
    rows = [{"prompt": "12*34?", "answer": "408"}, {"prompt": "12*34?", "answer": "407"}]
    tok, samples = _run(env, [CALL, "408"], rows)
    assert called == [(12, 34), (12, 34)]
    assert [s.metadata["env"]["outcome"] for s in samples] == [1.0, 0.0]  # the rubric's reward
    for s in samples:
        info = s.metadata["env"]
        assert info["error"] is None and info["turns"] == 2 and info["prefix_breaks"] == 0
        text = tok.decode(s.prompt_ids + s.response_ids)
        assert "Use the tool." in text and '"name": "multiply"' in text  # system, tools schema
        assert "<tool_response>\n408\n</tool_response>" in text
        trained = tok.decode([t for t, k in zip(s.response_ids, s.loss_mask, strict=True) if k])
        assert trained == CALL + "<|im_end|>" + "408<|im_end|>"


def test_a_verifiers_single_turn_env_runs_unchanged():
    env = vf.SingleTurnEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[correct]))
    _, samples = _run(env, ["408"], [{"prompt": "12*34?", "answer": "408"}])
    (s,) = samples
    assert s.metadata["env"]["outcome"] == 1.0 and s.metadata["env"]["turns"] == 1


def _tool_agent():
    env = vf.ToolEnv(
        tools=[multiply], dataset=_dataset(), max_turns=2, rubric=vf.Rubric(funcs=[correct])
    )
    return verifiers_agent(env, sampling_args={"max_tokens": 8})


vf_tool_agent = _tool_agent()


def test_grpo_trains_through_a_verifiers_tool_env(tmp_path):
    import json

    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train
    from relayrl.model import build_tiny_model, load_tokenizer

    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    tok = load_tokenizer(model)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model)
    cfg = run_config(
        model,
        tmp_path / "run",
        "env.agent.function=test_env_verifiers:vf_tool_agent",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "rollout.max_tokens=8",
        "data.eval_size=2",
        "train.steps=2",
        "train.save_every=0",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 2
    assert all(r["env/agent_rollouts"] == 4 and r.get("env/agent_failures", 0) == 0 for r in steps)

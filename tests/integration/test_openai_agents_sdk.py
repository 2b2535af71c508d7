"""The official OpenAI Agents SDK (PyPI ``openai-agents``) drives a tool-using agent through
the endpoint's Responses API, as an ``env.agent.function`` rollout: its function tool is called
with the model's arguments, its final answer is the model's, and every recorded call is the
engine's tokens (Qwen2.5 template, scripted replies; 0 prefix breaks); also with
``Runner.run_streamed`` (``/v1/responses`` with ``stream: true``: the answer's text deltas)."""

from __future__ import annotations

import pytest

from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.env.agent_rollout import AgentRollout
from relayrl.rollout import GenerationRequest, SamplingParams

agents = pytest.importorskip("agents")

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
seen: list[tuple[int, int]] = []
deltas: list[str] = []


async def sdk_agent(base_url: str, api_key: str, row: dict) -> float:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        seen.append((a, b))
        return a * b

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[multiply], model=model)
    if row.get("stream"):  # Runner.run_streamed: /v1/responses with stream=true
        result = agents.Runner.run_streamed(agent, row["prompt"])
        async for event in result.stream_events():
            if event.type == "raw_response_event" and event.data.type.endswith("text.delta"):
                deltas.append(event.data.delta)
    else:
        result = await agents.Runner.run(agent, row["prompt"])
    return 1.0 if str(result.final_output).strip() == row["answer"] else 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_agents_sdk_agent_runs_through_the_endpoint(stream):
    seen.clear()
    deltas.clear()
    tok = qwen_tokenizer()
    engine = ScriptedEngine(tok, [CALL, "408"])
    rollout = AgentRollout(engine, tok, sdk_agent, timeout_s=60, concurrency=2)
    reqs = [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=100, seed=i),
            group_id=0,
            metadata={"prompt": "12*34?", "answer": "408", "stream": stream},
        )
        for i in range(2)
    ]
    try:
        samples = rollout.generate(reqs)
    finally:
        rollout.close()
    assert seen == [(12, 34), (12, 34)]
    assert deltas == (["408", "408"] if stream else [])  # the answers' text, streamed
    for s in samples:
        info = s.metadata["env"]
        assert info["error"] is None and info["outcome"] == 1.0 and info["turns"] == 2
        assert info["prefix_breaks"] == 0 and not info["segments"]
        text = tok.decode(s.prompt_ids + s.response_ids)
        assert "<tool_response>\n408\n</tool_response>" in text
        trained = tok.decode([t for t, k in zip(s.response_ids, s.loss_mask, strict=True) if k])
        assert trained == CALL + "<|im_end|>" + "408<|im_end|>"


def test_an_agent_rollout_spanning_a_weight_update_counts_as_interrupted():
    tok = qwen_tokenizer()
    engine = ScriptedEngine(tok, ["a", "b"])

    def agent(base_url: str, api_key: str, row: dict) -> float:
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="p", messages=msgs, max_tokens=5)
        engine.version = 1  # a weight update between the two calls
        msgs += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "again"},
        ]
        client.chat.completions.create(model="p", messages=msgs, max_tokens=5)
        return 1.0

    rollout = AgentRollout(engine, tok, agent, timeout_s=30)
    try:
        (s,) = rollout.generate(
            [GenerationRequest([1], SamplingParams(max_tokens=5), metadata={"prompt": "x"})]
        )
    finally:
        rollout.close()
    assert {v for v, k in zip(s.versions, s.loss_mask, strict=True) if k} == {0, 1}
    assert s.num_interrupts == 1


def test_an_agent_may_return_per_call_rewards_keyed_by_reply_id():
    import torch

    from relayrl.env.turn_credit import turn_advantages

    tok = qwen_tokenizer()
    engine = ScriptedEngine(tok, ["first", "second"])

    def agent(base_url: str, api_key: str, row: dict) -> dict:
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        r1 = client.chat.completions.create(model="p", messages=msgs, max_tokens=9)
        msgs += [
            r1.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more"},
        ]
        r2 = client.responses.create(model="p", input=msgs, max_output_tokens=9)
        if row.get("bad"):
            return {"chatcmpl-nope": 1.0}
        return {r1.id: row["r1"], r2.id: row["r2"]}

    rollout = AgentRollout(engine, tok, agent, timeout_s=30)
    rows = [{"r1": 0.5, "r2": 1.0}, {"r1": 0.0, "r2": 0.0}, {"bad": True}]
    try:
        samples = rollout.generate(
            [
                GenerationRequest([1], SamplingParams(max_tokens=9), group_id=0, metadata=r)
                for r in rows
            ]
        )
    finally:
        rollout.close()
    a, b, bad = (s.metadata["env"] for s in samples)
    assert a["outcome"] == 1.0 and a["turn_rewards"] == [0.5] and len(a["turn_spans"]) == 2
    assert b["outcome"] == 0.0 and b["turn_rewards"] == [0.0]
    assert bad["stop_reason"] == "env_error" and "not a call of its rollout" in bad["error"]
    (s1, e1), (s2, e2) = a["turn_spans"]
    assert tok.decode(samples[0].response_ids[s1:e1]) == "first<|im_end|>"
    assert tok.decode(samples[0].response_ids[s2:e2]) == "second<|im_end|>"
    # per-turn credit over the two good rollouts: returns (1.5, 1.0) vs (0, 0)
    good = samples[:2]
    n = max(len(s.response_ids) for s in good)
    mask = torch.zeros(2, n)
    for i, s in enumerate(good):
        mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    adv = turn_advantages(good, torch.tensor([1.0, 0.0]), mask, [0, 0], eps=0.0)
    assert adv[0, s1].item() == 1.0 and adv[1, s1].item() == -1.0

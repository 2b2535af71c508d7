"""Hung synchronous agents neither starve the agent pool nor hold up the process's exit:
with every slot first taken by an agent that blocks far past ``env.agent.timeout_s``, the
other rollouts still run (before: 16/16 timed out) and a process whose agent never returns
exits at once after ``close``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest

from relayrl.env.agent_rollout import AgentRollout
from relayrl.model import load_causal_lm, load_tokenizer
from relayrl.model.tiny import build_tiny_model
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = build_tiny_model(tmp_path_factory.mktemp("agent_iso") / "m", hidden_size=32)
    tok = load_tokenizer(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def agent(base_url: str, api_key: str, row: dict) -> float:
    """Blocks its thread for 30 s on rows with ``hang``; else one chat call, reward 1."""
    if row.get("hang"):
        time.sleep(30)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
    client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=3
    )
    return 1.0


def _requests(n: int, hung: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=3, seed=i),
            group_id=i,
            metadata={"prompt": "1+1=", "hang": i < hung},
        )
        for i in range(n)
    ]


def test_hung_sync_agents_do_not_starve_the_pool(model_dir):
    tok = load_tokenizer(model_dir)
    engine = RolloutEngine(
        load_causal_lm(model_dir), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    rollout = AgentRollout(engine, tok, agent, timeout_s=2.0, concurrency=4)
    t0 = time.perf_counter()
    try:
        samples = rollout.generate(_requests(16, hung=4))  # the 4 hung ones start first
        wall = time.perf_counter() - t0
        again = rollout.generate(_requests(4, hung=0))  # a later evaluation: a free pool
        stats = rollout.stats()
    finally:
        rollout.close()
    reasons = [s.metadata["env"]["stop_reason"] for s in samples]
    assert reasons == ["timeout"] * 4 + ["env_done"] * 12, reasons
    assert [s.metadata["env"]["outcome"] for s in again] == [1.0] * 4
    assert stats["agent/abandoned"] == 4 and stats["agent/failures"] == 4
    assert wall < 15, wall


def test_a_hung_agent_does_not_hold_up_the_exit(model_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from relayrl.env.agent_rollout import AgentRollout
        from relayrl.model import load_causal_lm, load_tokenizer
        from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

        def agent(base_url, api_key, row):
            time.sleep(600)  # never returns within the run

        tok = load_tokenizer({str(model_dir)!r})
        engine = RolloutEngine(load_causal_lm({str(model_dir)!r}), eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        rollout = AgentRollout(engine, tok, agent, timeout_s=0.5, concurrency=2)
        req = GenerationRequest([1], SamplingParams(max_tokens=3), metadata={{"prompt": "1"}})
        (s,) = rollout.generate([req])
        assert s.metadata["env"]["stop_reason"] == "timeout"
        rollout.close()
        print("closed", flush=True)
    """)
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr[-2000:]
    assert wall < 30, wall  # the agent's 600 s sleep is not waited for


def test_a_spinning_agent_in_a_worker_process_is_killed(model_dir):
    import os

    from env_workers import spinning_agent

    tok = load_tokenizer(model_dir)
    engine = RolloutEngine(
        load_causal_lm(model_dir), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    rollout = AgentRollout(
        engine, tok, spinning_agent, timeout_s=15.0, concurrency=2, isolation="process"
    )
    reqs = [
        GenerationRequest(
            [1],
            SamplingParams(max_tokens=3, seed=i),
            group_id=i,
            metadata={"prompt": "1+1=", "spin": i == 0},
        )
        for i in range(2)
    ]
    try:
        samples = rollout.generate(reqs)
    finally:
        rollout.close()
    assert [s.metadata["env"]["stop_reason"] for s in samples] == ["timeout", "env_done"]
    assert samples[1].metadata["env"]["outcome"] == 0.5
    pids = rollout.agent.pids
    assert len(pids) == 2
    for pid in pids:  # both workers are gone (the spinning one killed, not abandoned)
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )

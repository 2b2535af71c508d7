"""MCP tools through the official ``mcp`` package: a real stdio MCP server written here, its
tools offered to the model (rendered by a Qwen2.5 template's ``tools``) and called through the
MCP client; a rejected call is the model's mistake shown to it; GRPO trains through it."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from helpers import run_config
from qwen_template import ScriptedEngine, qwen_tokenizer
from relayrl.cluster.local import build_local_roles
from relayrl.controller.trainer import train
from relayrl.env import ChatTemplateRenderer
from relayrl.env.mcp_tools import MCPToolEnvironment
from relayrl.env.runner import EpisodeRunner, RunnerLimits
from relayrl.model import build_tiny_model
from relayrl.rollout import GenerationRequest, SamplingParams

pytest.importorskip("mcp")

SERVER = '''
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("calc")


@mcp.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


if __name__ == "__main__":
    mcp.run()
'''
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "multiply", "arguments": {"a": "x", "b": 34}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(textwrap.dedent(SERVER))
    return [sys.executable, str(path)]


def test_an_mcp_servers_tools_are_offered_and_called(server):
    tok = qwen_tokenizer()
    envs: list[MCPToolEnvironment] = []

    def factory():
        envs.append(MCPToolEnvironment(server))
        return envs[-1]

    engine = ScriptedEngine(tok, [BAD, CALL, "408"])
    runner = EpisodeRunner(
        engine,
        factory,
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=4, max_model_len=8192, step_timeout_s=60),
        concurrency=2,
    )
    reqs = [
        GenerationRequest(
            [1], SamplingParams(max_tokens=200, seed=i), group_id=i, metadata={"prompt": "12*34="}
        )
        for i in range(2)
    ]
    try:
        samples = runner.generate(reqs)
        m = runner.env_metrics()
    finally:
        runner.close()
    assert m.get("env/failures", 0) == 0 and m["env/tool_calls"] == 4 and m["env/tool_errors"] == 2
    for s in samples:
        assert s.metadata["env"]["stop_reason"] == "env_done"
        prompt = tok.decode(s.prompt_ids)
        assert '"name": "multiply"' in prompt  # the server's schema, rendered by the template
        text = tok.decode(s.response_ids)
        assert "<tool_response>\nerror: multiply failed: Error executing tool multiply" in text
        assert "<tool_response>\n408\n</tool_response>" in text
        assert s.metadata["env"]["prefix_breaks"] == 0
    assert len(envs) == 2 and all(e.server._task is None for e in envs)  # servers stopped


def test_a_server_that_cannot_start_is_an_environment_failure(tmp_path):
    tok = qwen_tokenizer()
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(3)\n")
    runner = EpisodeRunner(
        ScriptedEngine(tok, ["x"]),
        lambda: MCPToolEnvironment([sys.executable, str(bad)], call_timeout_s=20),
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=2, max_model_len=4096, step_timeout_s=30),
    )
    req = GenerationRequest([1], SamplingParams(max_tokens=10), metadata={"prompt": "1"})
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    assert s.metadata["env"]["stop_reason"] == "env_error"
    assert "MCP server" in s.metadata["env"]["error"]


def test_grpo_trains_through_an_mcp_tool_environment(server, tmp_path):
    model = build_tiny_model(tmp_path / "m", hidden_size=32, seed=1)
    cfg = run_config(
        model,
        tmp_path / "run",
        "data.arithmetic.operators=['*']",
        "data.eval_size=2",
        "env.factory=mcp",
        f"env.kwargs={json.dumps({'command': server})}",
        "env.max_turns=2",
        "env.concurrency=2",
        "env.step_timeout_s=60",
        "rollout.max_tokens=12",
        "algo.prompts_per_step=2",
        "algo.group_size=2",
        "train.save_every=0",
        "train.steps=2",
    )
    train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    assert len(steps) == 2
    assert all(r["env/episodes"] == 4 and r.get("env/failures", 0) == 0 for r in steps)
    assert sum(r.get("env/pool_created", 0) for r in recs) <= 2 + 2  # reused (+ the eval's)


CRASHING_SERVER = '''
import os
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("crashing")


@mcp.tool()
def crash() -> str:
    """Exit the server process in the middle of the call."""
    os._exit(1)


if __name__ == "__main__":
    mcp.run()
'''


def test_a_server_that_dies_mid_episode_is_an_environment_failure(tmp_path):
    """The server process exits while answering turn 1's call: the episode ends ``env_error``
    with the MCP error (not a tool error shown to the model, not a hang), nothing trained."""
    path = tmp_path / "crashing.py"
    path.write_text(textwrap.dedent(CRASHING_SERVER))
    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "crash", "arguments": {}}\n</tool_call>'
    runner = EpisodeRunner(
        ScriptedEngine(tok, [call, "408"]),
        lambda: MCPToolEnvironment([sys.executable, str(path)], call_timeout_s=30),
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=4, max_model_len=8192, step_timeout_s=60),
    )
    req = GenerationRequest([1], SamplingParams(max_tokens=100), metadata={"prompt": "1"})
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    info = s.metadata["env"]
    assert info["stop_reason"] == "env_error"
    assert "MCP call 'crash' failed" in info["error"] and "did not answer" not in info["error"]
    assert s.loss_mask is not None and not any(s.loss_mask)


ERRORS_SERVER = '''
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

mcp = MCPServer("errors")


@mcp.tool()
def balance(account: int) -> str:
    """An account's balance."""
    raise ToolError(f"no such account: {account}")


@mcp.tool()
def crash() -> str:
    """A tool with a bug."""
    raise ValueError("secret internal detail")


if __name__ == "__main__":
    mcp.run()
'''


def test_a_tool_error_shows_the_model_the_servers_message(tmp_path):
    """The server's error text reaches the model, as MCP clients show it: a tool's deliberate
    ``ToolError`` message and an argument-validation message follow ``Error executing tool
    <name>``; a crash's text the SDK's server withholds itself (only the generic line is sent,
    mcp.server.mcpserver.exceptions.UnexpectedToolError), so the model sees only that."""
    path = tmp_path / "errors.py"
    path.write_text(textwrap.dedent(ERRORS_SERVER))
    tok = qwen_tokenizer()
    calls = "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
        for n, a in [("balance", {"account": 7}), ("balance", {"account": "x"}), ("crash", {})]
    )
    runner = EpisodeRunner(
        ScriptedEngine(tok, [calls, "done"]),
        lambda: MCPToolEnvironment([sys.executable, str(path)], call_timeout_s=30),
        ChatTemplateRenderer(tok),
        RunnerLimits(max_turns=4, max_model_len=8192, step_timeout_s=60),
    )
    req = GenerationRequest([1], SamplingParams(max_tokens=100), metadata={"prompt": "1"})
    try:
        (s,) = runner.generate([req])
    finally:
        runner.close()
    assert s.metadata["env"]["stop_reason"] == "env_done"
    text = tok.decode(s.response_ids)
    assert "error: balance failed: Error executing tool balance: no such account: 7" in text
    assert "Input should be a valid integer" in text
    assert "error: crash failed: Error executing tool crash\n</tool_response>" in text
    assert "secret internal detail" not in text

"""Tools: schema from signature and docstring, the tool-call format, model mistakes shown to
the model as tool errors."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.env import EnvError
from relayrl.env.tools import ToolEnvironment, Toolset, parse_tool_calls, tool_schema


def add(a: int, b: float = 1.0, note: str = "") -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


def broken_infra() -> str:
    """Fails like a dead backend."""
    raise EnvError("backend gone")


def test_schema_from_signature_and_docstring():
    s = tool_schema(add)
    assert s == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number"},
                    "b": {"type": "number", "description": "the second number"},
                    "note": {"type": "string"},
                },
                "required": ["a"],
            },
        },
    }
    assert tool_schema(shout)["function"]["description"] == "Upper-case a text."


def test_parse_tool_calls_format_and_errors():
    text = (
        'x <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
        "<tool_call>{bad json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
        "<tool_call>unclosed"
    )
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2}), ("add", {"a": 3})]
    assert errors[0].startswith("tool call 2 is not valid JSON")
    assert errors[1].startswith("tool call 3 needs")
    assert errors[2] == "a <tool_call> tag is not closed with </tool_call>"


def test_toolset_runs_sync_and_async_tools_and_reports_mistakes():
    ts = Toolset([add, shout, broken_infra])
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 0.5}}</tool_call>'
        '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
        "<tool_call>[1</tool_call>"
    )
    msgs, n, failed = asyncio.run(ts.run(text))
    contents = [m["content"] for m in msgs]
    assert contents[0].startswith("error: tool call 5 is not valid JSON")
    assert contents[1:3] == ["2.5", "HI"]
    assert contents[3].startswith("error: unknown tool 'nope'")
    assert contents[4].startswith("error: bad arguments for add")
    assert all(m["role"] == "tool" for m in msgs)
    assert (n, failed) == (5, 3)
    with pytest.raises(EnvError, match="backend gone"):
        asyncio.run(ts.run('<tool_call>{"name": "broken_infra", "arguments": {}}</tool_call>'))


def test_tool_environment_episode_in_a_few_lines():
    env = ToolEnvironment([add], system_prompt="use add")
    first = asyncio.run(env.reset({"prompt": "2+3?"}))
    assert first == [{"role": "system", "content": "use add"}, {"role": "user", "content": "2+3?"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    r = asyncio.run(env.step({"role": "assistant", "content": call}))
    assert not r.done and r.observation[0]["content"] == "5"
    assert r.info == {"tool_calls": 1, "tool_errors": 0}
    assert asyncio.run(env.step({"role": "assistant", "content": "5"})).done

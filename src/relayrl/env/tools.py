"""Tools: plain Python functions (sync or async) offered to the model.

Schema. ``tool_schema(fn)`` builds the OpenAI function schema from the signature and the
docstring: the first paragraph is the description; an ``Args:`` section's ``name: text`` lines
describe the parameters; annotations map ``str`` -> string, ``int`` -> integer, ``float`` ->
number, ``bool`` -> boolean, ``list`` -> array, ``dict`` -> object; parameters without a
default are required.

Call format (the one format the model writes, also what Qwen-style chat templates use)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

Any number of calls per assistant turn. A call whose JSON does not parse, that names an
unknown tool, whose arguments do not fit the signature, or whose tool raises, becomes a tool
message ``error: ...`` shown to the model (:class:`~relayrl.env.types.ToolError`); the episode
goes on. An :class:`~relayrl.env.types.EnvError` raised by a tool ends the episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from relayrl.env.environment import Environment
from relayrl.env.types import EnvError, Message, StepResult, ToolError

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"
_JSON_TYPES: dict[object, str] = {  # keyed by annotation (or its origin)
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(annotation: Any) -> str:
    origin = getattr(annotation, "__origin__", None)
    return _JSON_TYPES.get(annotation) or _JSON_TYPES.get(origin) or "string"


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].strip().replace("\n", " ")
    params: dict[str, str] = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*$(.*?)(?:^\S|\Z)", doc, re.M | re.S)
    if m:
        for line in m.group(2).splitlines():
            pm = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if pm:
                params[pm.group(1)] = pm.group(2).strip()
    return description, params


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI ``{"type": "function", "function": {...}}`` schema of ``fn`` (see module)."""
    sig = inspect.signature(fn)
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable annotations: strings in the schema
        hints = {}
    description, docs = _doc_parts(fn)
    props: dict[str, Any] = {}
    required = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop: dict[str, Any] = {"type": _json_type(hints.get(p.name, str))}
        if p.name in docs:
            prop["description"] = docs[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in an assistant turn's text, and an error text for each malformed one
    (bad JSON, not an object, no ``name``, ``arguments`` not an object, an unclosed tag)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(TOOL_CALL_RE.finditer(text)):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {i + 1} is not valid JSON ({e.msg} at char {e.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(f'tool call {i + 1} needs {{"name": ..., "arguments": {{...}}}}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"tool call {i + 1}: arguments must be a JSON object")
            continue
        calls.append(ToolCall(obj["name"], args, f"call_{i}"))
    if text.count(OPEN_TAG) > len(TOOL_CALL_RE.findall(text)):
        errors.append("a <tool_call> tag is not closed with </tool_call>")
    return calls, errors


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """An assistant turn's text as an OpenAI-style message's parts: the content without its
    ``<tool_call>`` blocks (stripped), and the well-formed calls. A chat template renders the
    calls from ``tool_calls``, so a transcript whose content still held them would show every
    call twice."""
    calls, _ = parse_tool_calls(text)
    return TOOL_CALL_RE.sub("", text).strip(), calls


def assistant_message(text: str) -> tuple[Message, Message]:
    """The two assistant messages of a turn: what the environment's ``step`` gets (the
    model's text as written as ``content``, plus ``tool_calls`` when it called tools) and the
    transcript's (``content`` without the call blocks, the calls in ``tool_calls`` only, as a
    chat template expects)."""
    step: Message = {"role": "assistant", "content": text}
    if OPEN_TAG not in text:
        return step, dict(step)
    content, calls = split_tool_calls(text)
    tool_calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    step["tool_calls"] = tool_calls
    return step, {"role": "assistant", "content": content, "tool_calls": tool_calls}


class Toolset:
    """Named tools (plain sync or async functions) with their schemas."""

    def __init__(self, tools: Sequence[Callable[..., Any]] | Mapping[str, Callable[..., Any]]):
        items = tools.items() if isinstance(tools, Mapping) else ((f.__name__, f) for f in tools)
        self.functions: dict[str, Callable[..., Any]] = dict(items)
        self.schemas = [tool_schema(f, n) for n, f in self.functions.items()]

    async def call(self, call: ToolCall) -> str:
        """Run one call; a model mistake raises :class:`ToolError` (see module)."""
        fn = self.functions.get(call.name)
        if fn is None:
            raise ToolError(f"unknown tool {call.name!r} (tools: {', '.join(self.functions)})")
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            raise ToolError(f"bad arguments for {call.name}: {e}") from None
        try:
            out = await _call(fn, call.arguments)
        except (ToolError, EnvError):
            raise
        except Exception as e:  # the tool rejected its arguments: the model sees why
            raise ToolError(f"{call.name} failed: {type(e).__name__}: {e}") from None
        return out if isinstance(out, str) else json.dumps(out)

    async def run(self, text: str) -> tuple[list[Message], int, int]:
        """Tool messages answering every call in ``text`` (errors included, in order), the
        number of calls and the number of them that failed."""
        calls, errors = parse_tool_calls(text)
        out: list[Message] = [{"role": "tool", "content": f"error: {e}"} for e in errors]
        failed = len(errors)
        for c in calls:
            try:
                content = await self.call(c)
            except ToolError as e:
                content, failed = f"error: {e}", failed + 1
            out.append({"role": "tool", "content": content, "name": c.name, "tool_call_id": c.id})
        return out, len(calls) + len(errors), failed


async def _call(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    return await asyncio.to_thread(lambda: fn(**arguments))


class ToolEnvironment(Environment):
    """A tool-use task in a few lines: the row's prompt as the user message (after an optional
    system prompt); each assistant turn with tool calls gets their results as ``tool``
    messages; a turn without a tool call is the final answer (done). ``format_prompt(row)``
    may build the user message from the row instead.

    ``info`` of each step holds ``tool_calls`` and ``tool_errors`` (counted in ``env/*``)."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] | Mapping[str, Callable[..., Any]],
        system_prompt: str | None = None,
        format_prompt: Callable[[Mapping[str, Any]], str] | None = None,
    ):
        self.toolset = Toolset(tools)
        self.tools = self.toolset.schemas
        self.system_prompt = system_prompt
        self.format_prompt = format_prompt

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        text = self.format_prompt(row) if self.format_prompt else str(row.get("prompt", ""))
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*head, {"role": "user", "content": text}]

    async def step(self, message: Message) -> StepResult:
        text = message["content"]
        if OPEN_TAG not in text:
            return StepResult(done=True)
        obs, n, failed = await self.toolset.run(text)
        return StepResult(obs, info={"tool_calls": n, "tool_errors": failed})

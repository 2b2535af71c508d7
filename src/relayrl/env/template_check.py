"""The start-up check of a chat template's tool calls: render, parse, re-render one call.

``check_tool_template(renderer)`` renders a one-tool conversation through the run's tokenizer
and template, takes the text the template puts in the assistant's turn for a call (what a
model trained on that template writes), tokenises it as the engine would produce it, decodes
it as the runner does (``renderer.assistant_text``), parses it (``relayrl.env.tools``) and
re-renders the conversation from the parsed call. It reports, in a :class:`TemplateCheck`:

- ``parses``: the call comes back with its name and arguments (else the template writes tool
  calls in a format the ``<tool_call>{json}</tool_call>`` parser does not read, or its tool
  tags vanish in decoding);
- ``bridge_holds``: the template's text after the call (tool result, next generation prompt)
  can be bridged onto the call's tokens (the default rendering; the prefix then holds by
  construction);
- ``rerender_holds``: re-rendering the whole conversation starts with the previous context
  token for token (what ``env.render: template_rerender`` needs; it fails for templates that
  re-space the call's JSON or drop earlier turns);
- ``problem``: one line naming what fails, or None.

The episode runner runs it once when it is built over a chat template and logs a warning
naming the template's problem when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.env.render import SENTINEL, ChatTemplateRenderer, TemplateBridgeError
from relayrl.env.tools import assistant_message, tool_schema
from relayrl.env.trajectory import TrajectoryBuilder


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@dataclass
class TemplateCheck:
    parses: bool = False
    bridge_holds: bool = False
    rerender_holds: bool = False
    call_text: str = ""
    problem: str | None = None


def _call_text(r: ChatTemplateRenderer, msgs: list[dict], tools: list[dict]) -> str:
    """The template's text of the assistant's tool-call turn, without its closing text."""
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": call}]}  # fmt: skip
    prompt = r.text(msgs, tools, add_generation_prompt=True)
    full = r.text([*msgs, turn], tools, add_generation_prompt=False)
    closed = r.text([*msgs, {"role": "assistant", "content": SENTINEL}], tools, False)
    closing = closed[closed.rfind(SENTINEL) + len(SENTINEL) :]
    if not full.startswith(prompt):
        raise TemplateBridgeError("the assistant turn does not start with the generation prompt")
    body = full[len(prompt) :]
    return body[: len(body) - len(closing)] if closing and body.endswith(closing) else body


def check_tool_template(renderer: ChatTemplateRenderer) -> TemplateCheck:
    """Render, parse and re-render one tool call (see module)."""
    r, tok, out = renderer, renderer.tokenizer, TemplateCheck()
    tools = [tool_schema(add)]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "What is 2+3?"}]
    try:
        out.call_text = _call_text(r, msgs, tools)
        ids = list(tok(out.call_text, add_special_tokens=False)["input_ids"])
        ids += r.stop_ids[:1] or [tok.eos_token_id]
        text = r.assistant_text(ids)
        step, transcript = assistant_message(text)
        calls = step.get("tool_calls") or []
        fn = calls[0]["function"] if len(calls) == 1 else {}
        out.parses = fn.get("name") == "add" and fn.get("arguments") == {"a": 2, "b": 3}
        if "add" not in out.call_text:
            out.problem = "the chat template renders no tool calls (it ignores tool_calls)"
        elif not out.parses:
            out.problem = (
                f"the template writes a tool call as {out.call_text!r}, which decodes to "
                f"{text!r}: relayrl's parser (<tool_call>{{json}}</tool_call>) finds "
                f"{len(calls)} call(s) in it; the model's calls would not reach the tools"
            )
        prompt = r.conversation(msgs, tools)
        obs = [{"role": "tool", "content": "5", "name": "add", "tool_call_id": "call_0"}]
        history = [*msgs, transcript]
        bridge = r.observation(obs, history, tools, ids)
        out.bridge_holds = bool(bridge)  # rendered without a TemplateBridgeError
        b = TrajectoryBuilder(prompt)
        b.add_turn(prompt, ids, [0.0] * len(ids), [0] * len(ids))
        out.rerender_holds = b.extend_to(r.conversation([*history, *obs], tools))
        if out.problem is None and not out.rerender_holds:
            out.problem = (
                "re-rendering the conversation does not reproduce the model's tool-call tokens "
                "(env.render: template_rerender would start a new sample every tool turn; the "
                "bridged default is not affected)"
            )
    except Exception as e:  # noqa: BLE001  (a template that cannot render tools at all)
        out.problem = f"the chat template cannot render a tool call: {type(e).__name__}: {e}"
    return out

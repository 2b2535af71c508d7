"""Chat messages in the OpenAI format -> prompt token ids, and generated ids -> a message.

Rendering (``ChatRendering.prompt_ids``) is of the whole conversation each call, as an
OpenAI-compatible server must (the client sends every message every time):

- tokenizer with a chat template: ``apply_chat_template(messages, tools=tools,
  add_generation_prompt=True)``; ``tools`` reach the template (a template without tool
  support ignores them). Assistant tool calls have their ``arguments`` JSON string decoded to
  an object first (what Hugging Face templates expect); content given as a list of text parts
  is joined.
- tokenizer without one (the tiny character tokenizer): the plain format of
  :mod:`relayrl.env.render` rendered whole: ``PREFIX + content + "\\n"`` for system / user /
  tool messages, ``"A:" + content + EOS`` for an assistant message (the model ends its turn
  with EOS, which is part of its turn), ``"A:"`` to open the turn to generate. An assistant
  message whose content does not hold its tool calls gets them appended in the call format
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Tool schemas are not rendered
  (the task's prompt says how to call its tools). This equals ``PlainRenderer``'s
  incremental rendering token for token.

The reply (``ChatRendering.message``): the completion ids decoded without special tokens;
tool calls in ``<tool_call>`` blocks (:func:`relayrl.env.tools.parse_tool_calls`) become
OpenAI ``tool_calls``. With the plain format the content keeps the blocks (the raw text), so
a client that sends the message back as it got it re-renders the exact tokens; with a chat
template the content is the text outside the blocks (the template renders ``tool_calls`` in
its own format, as vLLM's tool parsers do). Either way the session checks the prefix
property and starts a new sample where a re-rendering differs from what was generated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from relayrl.env.render import (
    END_OF_TURN_TOKENS,
    PLAIN_PREFIXES,
    ending_ids,
    has_chat_template,
    visible_text,
)
from relayrl.env.tools import OPEN_TAG, TOOL_CALL_RE, parse_tool_calls

ROLES = ("system", "user", "assistant", "tool", "developer")


class BadMessages(ValueError):
    """The request's messages cannot be rendered (names the message index and the field)."""


def content_text(content: Any, where: str) -> str:
    """OpenAI message content (a string, None, or a list of ``{"type": "text"}`` parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadMessages(
                    f"{where}.content[{j}]: only text parts are supported, got {kind!r}"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadMessages(f"{where}.content must be a string or a list of text parts")


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of ``messages`` and return plain dicts with string content."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadMessages(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise BadMessages(f"{where}.role is {role!r}; expected one of {', '.join(ROLES)}")
        msg = {**m, "role": "system" if role == "developer" else role}
        msg["content"] = content_text(m.get("content"), where)
        calls = m.get("tool_calls")
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise BadMessages(f"{where}.tool_calls must be a list on an assistant message")
            msg["tool_calls"] = [
                _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        else:
            msg.pop("tool_calls", None)
        out.append(msg)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadMessages(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise BadMessages(f"{where}.function.arguments is not valid JSON ({e.msg})") from None
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def call_text(name: str, arguments: Any) -> str:
    """One call in the ``<tool_call>`` format (canonical JSON)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ChatRendering:
    """How this tokenizer turns conversations into ids and ids into reply messages."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.template = has_chat_template(tokenizer)
        vocab = tokenizer.get_vocab()
        end = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab] if self.template else []
        self.stop_ids: list[int] = end  # + the engine's EOS, which always ends a turn
        self.eos_id = int(tokenizer.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids of the conversation with the assistant turn opened (see module)."""
        if self.template:
            try:
                out = self.tokenizer.apply_chat_template(
                    list(messages),
                    tools=list(tools) if tools else None,
                    add_generation_prompt=True,
                    tokenize=True,
                )
            except Exception as e:  # a template's own raise_exception, a jinja error
                raise BadMessages(f"the chat template cannot render these messages: {e}") from None
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return [int(t) for t in out]
        ids: list[int] = []
        pending = ""
        for m in messages:
            if m["role"] == "assistant":
                text = m["content"]
                calls = m.get("tool_calls") or []
                if calls and OPEN_TAG not in text:
                    text += "".join(
                        call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls
                    )
                # the opening as PlainRenderer encodes it, then the turn as generated
                ids += self.encode(pending + PLAIN_PREFIXES["assistant"])
                ids += self.encode(text) + [self.eos_id]
                pending = ""
            else:
                pending += PLAIN_PREFIXES[m["role"]] + m["content"] + "\n"
        return ids + self.encode(pending + PLAIN_PREFIXES["assistant"])

    def message(self, completion_ids: Sequence[int], parse_tools: bool) -> dict[str, Any]:
        """The assistant message of a completion (``tool_calls`` when it holds valid ones)."""
        # special tokens kept (tool tags may be special tokens), the turn's end left out
        text = visible_text(
            self.tokenizer, completion_ids, ending_ids(self.tokenizer, self.stop_ids)
        )
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if not parse_tools or OPEN_TAG not in text:
            return msg
        calls, _errors = parse_tool_calls(text)
        if not calls:
            return msg  # malformed calls stay text: the agent sees what the model wrote
        msg["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        if self.template:
            rest = TOOL_CALL_RE.sub("", text).strip()
            msg["content"] = rest or None
        return msg

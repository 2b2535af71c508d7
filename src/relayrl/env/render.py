"""How a conversation becomes tokens: the one place that defines turn rendering.

Two renderers behind one small interface (``prompt`` / ``observation`` / ``conversation``):

- :class:`PlainRenderer`, for tokenizers without a chat template (the tiny character
  tokenizer of ``relayrl.model.tiny``). Each message is ``PREFIX + content + "\\n"`` with the
  prefixes ``S:`` (system), ``U:`` (user), ``T:`` (tool) and the assistant turn opens with
  ``A:``; the model ends its turn with the EOS token, which is part of its turn (trained).
  So a conversation renders as::

      U:what is 12*34?\\nA:<tool_call>{...}</tool_call><eos>T:408\\nA:408<eos>

  It is *incremental*: the tokens after an assistant turn are ``observation(new messages)``
  (the rendered observation messages, then ``A:``), appended to the exact ids generated so far;
  no earlier turn is ever rendered or tokenised again, so the prefix property holds by
  construction. Tool schemas are not rendered (the task's prompt says how to call its tools).
- :class:`ChatTemplateRenderer`, for tokenizers with a chat template: the whole conversation
  (with ``tools=`` schemas, the template's own tool format) is rendered each turn through
  ``tokenizer.apply_chat_template``; the trajectory builder checks that the new rendering
  starts with the previous context token for token and starts a new training sample where
  it does not (a template that drops earlier reasoning, or re-tokenises an assistant turn
  differently from what was sampled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relayrl.env.types import Message

PLAIN_PREFIXES = {"system": "S:", "user": "U:", "tool": "T:", "assistant": "A:"}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class PlainRenderer:
    """``PREFIX + content + "\\n"`` per message, ``A:`` opens the assistant turn (see module)."""

    incremental = True

    def __init__(self, tokenizer: Any, prefixes: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.prefixes = {**PLAIN_PREFIXES, **(prefixes or {})}
        self.stop_ids: list[int] = []  # the engine's EOS ends the turn

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _messages(self, messages: Sequence[Message]) -> str:
        return "".join(self.prefixes[m["role"]] + m["content"] + "\n" for m in messages)

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """The first context: every message, then the assistant prefix."""
        return self._encode(self._messages(messages) + self.prefixes["assistant"])

    def observation(self, messages: Sequence[Message]) -> list[int]:
        """Tokens appended after an assistant turn: the observation messages, then ``A:``."""
        return self._encode(self._messages(messages) + self.prefixes["assistant"])

    def conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> list[int]:
        raise NotImplementedError("PlainRenderer is incremental: use prompt / observation")

    def assistant_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class ChatTemplateRenderer:
    """The tokenizer's chat template, re-rendered each turn (prefix checked by the builder)."""

    incremental = False

    def __init__(self, tokenizer: Any):
        if not has_chat_template(tokenizer):
            raise ValueError("the tokenizer has no chat_template: use PlainRenderer")
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.stop_ids = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]

    def conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=True,
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        return self.conversation(messages, tools)

    def observation(self, messages: Sequence[Message]) -> list[int]:
        raise NotImplementedError("ChatTemplateRenderer re-renders: use conversation")

    def assistant_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def make_renderer(tokenizer: Any, mode: str = "auto") -> PlainRenderer | ChatTemplateRenderer:
    """``auto``: the chat template when the tokenizer has one, else the plain rendering."""
    if mode == "plain" or (mode == "auto" and not has_chat_template(tokenizer)):
        return PlainRenderer(tokenizer)
    if mode in ("auto", "template"):
        return ChatTemplateRenderer(tokenizer)
    raise ValueError(f"env.render: unknown mode {mode!r} (auto | plain | template)")

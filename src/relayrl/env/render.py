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
- :class:`ChatTemplateRenderer`, for tokenizers with a chat template (with ``tools=`` schemas,
  the template's own tool format). By default it is *incremental* too (``bridge``): the first
  prompt is the template's rendering; after an assistant turn, the tokens appended to the
  exact ids the model generated are the template's own text between the end of that
  assistant message and the next generation prompt (the turn's closing text, which the
  model's end-of-turn token already covers when it stopped on it, then the observation
  messages, then the generation prompt), found by rendering the conversation with a sentinel
  in place of the last assistant turn, as prime-rl's renderers bridge turns. The model's own
  text is never re-rendered, so a template's normalisation of it (JSON spacing of a tool
  call, dropped reasoning, stripped whitespace) cannot break the prefix property.
  ``incremental=False`` (``env.render: template_rerender``) re-renders the whole
  conversation each turn instead; the trajectory builder then starts a new, counted training
  sample wherever the re-rendering does not start with the previous context.

Assistant text. ``assistant_text(ids)`` decodes a turn without dropping special tokens (tool
tags such as ``<tool_call>`` are special tokens in several real tokenizers), leaving out only
the end-of-turn / EOS / padding ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relayrl.env.types import Message

SENTINEL = "RELAYRL_TURN_SENTINEL_7F3A"
"""Stands in for the last assistant turn's content when a template bridge is rendered."""

PLAIN_PREFIXES = {"system": "S:", "user": "U:", "tool": "T:", "assistant": "A:"}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class TemplateBridgeError(ValueError):
    """The chat template cannot be bridged turn by turn (names what it does)."""


def ending_ids(tokenizer: Any, stop_ids: Sequence[int]) -> set[int]:
    """The ids a turn's visible text leaves out: end-of-turn stops, EOS, padding, BOS."""
    ids = {*stop_ids}
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            ids.add(v)
    return ids


def visible_text(tokenizer: Any, ids: Sequence[int], drop: set[int]) -> str:
    """``ids`` decoded with special tokens kept (tool tags), minus the ids in ``drop``."""
    return tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)


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

    def observation(
        self,
        messages: Sequence[Message],
        history: Sequence[Message] | None = None,
        tools: Sequence[dict] | None = None,
        turn_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Tokens appended after an assistant turn: the observation messages, then ``A:``
        (``history``, ``tools``, ``turn_ids``: unused, the chat template's bridge needs them)."""
        return self._encode(self._messages(messages) + self.prefixes["assistant"])

    def conversation(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> list[int]:
        raise NotImplementedError("PlainRenderer is incremental: use prompt / observation")

    def assistant_text(self, ids: Sequence[int]) -> str:
        return visible_text(self.tokenizer, ids, ending_ids(self.tokenizer, self.stop_ids))


class ChatTemplateRenderer:
    """The tokenizer's chat template: bridged turn by turn (``incremental``, the default) or
    re-rendered each turn (prefix checked by the builder); see module."""

    def __init__(self, tokenizer: Any, incremental: bool = True):
        if not has_chat_template(tokenizer):
            raise ValueError("the tokenizer has no chat_template: use PlainRenderer")
        self.tokenizer = tokenizer
        self.incremental = incremental
        vocab = tokenizer.get_vocab()
        self.stop_ids = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
        self._drop = ending_ids(tokenizer, self.stop_ids)
        self.drops_assistant_content = False
        """Seen while bridging: the template leaves out an assistant turn's content once
        messages follow it (deployment shows the model less than it generated from)."""

    def text(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text of ``messages`` (not tokenised)."""
        return str(
            self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        )

    def bridge_text(
        self,
        messages: Sequence[Message],
        history: Sequence[Message],
        tools: Sequence[dict] | None = None,
    ) -> str:
        """The template's text after the last assistant message of ``history`` (its closing
        text, ``messages``, the generation prompt); :class:`TemplateBridgeError` if the
        template does not render that message's content verbatim or re-renders what comes
        before it once ``messages`` follow."""
        if not history or history[-1].get("role") != "assistant":
            raise TemplateBridgeError("a bridge follows an assistant message")
        hist = [*history[:-1], {"role": "assistant", "content": SENTINEL}]
        base = self.text(hist, tools, add_generation_prompt=False)
        full = self.text([*hist, *messages], tools, add_generation_prompt=True)
        i = base.rfind(SENTINEL)
        if i < 0:
            raise TemplateBridgeError(
                "the chat template does not render the last assistant message's content"
            )
        head = base[: i + len(SENTINEL)]
        if full.startswith(head):
            return full[len(head) :]
        if full.startswith(base[:i]):  # the content is dropped once followed (old reasoning)
            self.drops_assistant_content = True
            return full[i:]
        raise TemplateBridgeError(
            "the chat template renders the conversation before the new messages differently "
            "once they follow"
        )

    def observation(
        self,
        messages: Sequence[Message],
        history: Sequence[Message] | None = None,
        tools: Sequence[dict] | None = None,
        turn_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """The ids appended after the assistant turn ``turn_ids`` (the last message of
        ``history``): the bridge's text, less the end-of-turn token the model generated."""
        tail = self.bridge_text(messages, history or [], tools)
        if turn_ids:
            end = self.tokenizer.decode([turn_ids[-1]], skip_special_tokens=False)
            if turn_ids[-1] in self._drop and end and tail.startswith(end):
                tail = tail[len(end) :]
        return list(self.tokenizer(tail, add_special_tokens=False)["input_ids"])

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

    def assistant_text(self, ids: Sequence[int]) -> str:
        return visible_text(self.tokenizer, ids, self._drop)


def make_renderer(tokenizer: Any, mode: str = "auto") -> PlainRenderer | ChatTemplateRenderer:
    """``auto``: the chat template (bridged) when the tokenizer has one, else the plain
    rendering; ``template_rerender``: the chat template re-rendered each turn."""
    if mode == "plain" or (mode == "auto" and not has_chat_template(tokenizer)):
        return PlainRenderer(tokenizer)
    if mode in ("auto", "template"):
        return ChatTemplateRenderer(tokenizer)
    if mode == "template_rerender":
        return ChatTemplateRenderer(tokenizer, incremental=False)
    raise ValueError(
        f"env.render: unknown mode {mode!r} (auto | plain | template | template_rerender)"
    )

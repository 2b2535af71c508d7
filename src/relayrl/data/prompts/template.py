"""Templating: the text a prompt is tokenised from, through the tokenizer's chat template.

``render_prompt`` applies the tokenizer's chat template when it has one and
``data.source.chat_template`` is on (the record's own ``messages`` turns if present, else one
user turn with the prompt, plus an optional system prompt, a trailing assistant turn dropped)
with the generation prompt appended; a tokenizer without a template gets the raw prompt.
"""

from __future__ import annotations

from typing import Any

from relayrl.data.records import PromptRecord

__all__ = ["has_chat_template", "render_prompt"]


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    record: PromptRecord,
    tokenizer: Any,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> tuple[str, bool]:
    """(text to tokenise, whether a chat template was applied)."""
    if not (use_chat_template and has_chat_template(tokenizer)):
        return record.prompt, False
    messages = record.extra.get("messages")
    if not isinstance(messages, list) or not messages:
        messages = [{"role": "user", "content": record.prompt}]
    if system_prompt and not any(
        isinstance(m, dict) and m.get("role") == "system" for m in messages
    ):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    # drop a trailing assistant turn: the policy writes it
    while messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text), True

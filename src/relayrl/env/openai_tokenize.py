"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (:mod:`relayrl.env.openai_server`).

- ``/tokenize`` with ``{"model", "prompt"}``: the ids ``/v1/completions`` would generate from
  for that text (no special tokens added, as the completions route encodes it;
  ``add_special_tokens: true`` adds the tokenizer's own). With ``{"model", "messages"}``
  (and ``tools``): the ids ``/v1/chat/completions`` would generate from (the chat template, or
  the plain format, with the assistant turn opened; ``add_generation_prompt: false`` and
  ``continue_final_message`` are refused: that prompt is never generated from here).
  Answer: ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the
  tokenizer's pieces with ``return_token_strs: true``, else null), as vLLM answers.
- ``/detokenize`` with ``{"model", "tokens"}``: ``{"prompt": decode(tokens)}`` (special tokens
  kept, as vLLM decodes it); an id outside the tokenizer's vocabulary is a 400.

Tokenising and decoding run off the event loop (:class:`relayrl.env.request_io.OffLoop`).
"""

from __future__ import annotations

from typing import Any

from relayrl.env.agent_chat import BadMessages, ChatRendering, normalise_messages
from relayrl.env.openai_api import APIError
from relayrl.env.request_io import OffLoop


def _encode(rendering: ChatRendering, text: str, special: bool) -> list[int]:
    return list(rendering.tokenizer(text, add_special_tokens=special)["input_ids"])


async def tokenize(off_loop: OffLoop, body: dict[str, Any], max_model_len: int | None) -> Any:
    """The ``/tokenize`` answer (see module)."""
    if "messages" in body:
        if body.get("add_generation_prompt") is False or body.get("continue_final_message"):
            raise APIError(
                400,
                "only the prompt with the assistant turn opened (add_generation_prompt: true) "
                "is tokenized here",
                "unsupported",
                "add_generation_prompt",
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "tools must be a list of tool definitions", "invalid_type", "tools")
        try:
            messages = normalise_messages(body.get("messages"))
            ids = await off_loop.run(ChatRendering.prompt_ids, messages, tools)
        except BadMessages as e:
            raise APIError(400, str(e), "invalid_messages", "messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(
                400, "give prompt (a string) or messages to tokenize", "invalid_type", "prompt"
            )
        ids = await off_loop.run(_encode, prompt, bool(body.get("add_special_tokens", False)))
    strs = None
    if body.get("return_token_strs"):
        strs = await off_loop.run(lambda r, t: list(r.tokenizer.convert_ids_to_tokens(t)), ids)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(off_loop: OffLoop, body: dict[str, Any], vocab_size: int) -> Any:
    """The ``/detokenize`` answer (see module)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise APIError(400, "tokens must be a list of token ids", "invalid_type", "tokens")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"token id {bad[0]} is outside the vocabulary (0 to {vocab_size - 1})",
            "invalid_value",
            "tokens",
        )
    text = await off_loop.run(lambda r, t: str(r.tokenizer.decode(t)), tokens)
    return {"prompt": text}

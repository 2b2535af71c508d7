"""The prompt format a model was fine-tuned in, recorded beside its weights.

``relayrl sft`` renders prompts as ``relayrl train | eval`` do (``render_prompt``: the chat
template when the tokenizer has one and ``data.source.chat_template`` is on) and writes the
format it used to ``prompt_format.json`` in its output. A run that would ask the model in the
other format gets a warning before it starts (:func:`format_mismatch`): a model SFT'd on raw
prompts and then asked through a chat template (or the reverse) scores near zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relayrl.data.prompts.template import has_chat_template

__all__ = ["FORMAT_FILE", "format_mismatch", "prompt_format", "read_prompt_format"]

FORMAT_FILE = "prompt_format.json"


def prompt_format(
    tokenizer: Any, use_chat_template: bool, system_prompt: str | None
) -> dict[str, Any]:
    """``{"format": "chat_template" | "raw", "system_prompt": ...}`` as rendered with these
    settings (the system prompt only counts under a template)."""
    templated = use_chat_template and has_chat_template(tokenizer)
    return {
        "format": "chat_template" if templated else "raw",
        "system_prompt": system_prompt if templated else None,
    }


def read_prompt_format(model_dir: str | Path) -> dict[str, Any] | None:
    """The recorded format of ``model_dir``, or None (no record, or one that cannot be read)."""
    try:
        found = json.loads((Path(model_dir) / FORMAT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def format_mismatch(
    model_dir: str | Path,
    tokenizer: Any,
    use_chat_template: bool,
    system_prompt: str | None,
    key: str = "data.source.chat_template",
) -> str | None:
    """A one-line warning when ``model_dir`` was fine-tuned in another prompt format than
    these settings render, else None."""
    recorded = read_prompt_format(model_dir)
    if recorded is None:
        return None
    now = prompt_format(tokenizer, use_chat_template, system_prompt)
    if recorded.get("format") != now["format"]:
        fix = f"{key}=false" if now["format"] == "chat_template" else f"{key}=true"
        return (
            f"warning: {model_dir} was fine-tuned on {_words(recorded)} ({FORMAT_FILE}) but "
            f"this run renders {_words(now)}; set {fix} to ask it as it was trained"
        )
    if recorded.get("system_prompt") != now["system_prompt"]:
        return (
            f"warning: {model_dir} was fine-tuned with system prompt "
            f"{recorded.get('system_prompt')!r} ({FORMAT_FILE}) but this run uses "
            f"{now['system_prompt']!r}"
        )
    return None


def _words(fmt: dict[str, Any]) -> str:
    return "prompts in its chat template" if fmt.get("format") == "chat_template" else "raw prompts"

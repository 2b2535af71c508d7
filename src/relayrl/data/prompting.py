"""Prompt text to token ids, once: chat templates, length limit, a report of what was skipped.

``render_prompt`` applies the tokenizer's chat template when it has one (the record's own
``messages`` turns if present, else one user turn with the prompt, plus an optional system
prompt) with the generation prompt appended; a tokenizer without a template gets the raw
prompt. ``tokenize_prompts`` tokenises each rendered prompt once (token in, token out) and
skips, and counts, prompts that are empty or longer than ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.data.records import PromptRecord

__all__ = [
    "SkipReport",
    "encode_prompts",
    "has_chat_template",
    "render_prompt",
    "tokenize_prompts",
]

TOKENIZE_BATCH = 1024
"""Rendered prompts per tokenizer call in ``tokenize_prompts``."""


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


@dataclass
class SkipReport:
    """Prompts dropped by ``tokenize_prompts``: how many, why, and a few examples."""

    total: int = 0
    too_long: int = 0
    empty: int = 0
    max_tokens: int = 0
    longest: int = 0
    """Token count of the longest prompt skipped for length (0 when none was)."""
    examples: list[str] = field(default_factory=list)

    def note(self, rec: PromptRecord, ids: list[int]) -> bool:
        """Count ``rec`` (tokenised to ``ids``) as kept (True) or skipped: empty, or longer
        than ``max_tokens`` (False)."""
        if not ids:
            self.empty += 1
            return False
        if len(ids) > self.max_tokens:
            self.too_long += 1
            self.longest = max(self.longest, len(ids))
            if len(self.examples) < 3:
                self.examples.append(rec.prompt[:80])
            return False
        return True

    @property
    def skipped(self) -> int:
        return self.too_long + self.empty

    def message(self) -> str:
        """One line for the log ('' when nothing was skipped)."""
        if not self.skipped:
            return ""
        return (
            f"skipped {self.skipped} of {self.total} prompts ({self.too_long} longer than "
            f"{self.max_tokens} tokens, {self.empty} empty)"
        )

    def why_none(self, source: str, key: str = "data.max_prompt_tokens") -> str:
        """Why no prompt of ``source`` was kept, in one line naming the length ``key``:
        ``3 of 3 prompts in p.jsonl are longer than data.max_prompt_tokens=16 tokens
        (longest 40)``."""
        too_long = (
            f"{self.too_long} of {self.total} prompts in {source} are longer than "
            f"{key}={self.max_tokens} tokens (longest {self.longest})"
        )
        if self.too_long == self.total:
            return too_long
        if self.empty == self.total:
            return f"{source}: no usable prompts: all {self.total} are empty"
        if self.too_long:
            return f"no usable prompts: {too_long}, and {self.empty} are empty"
        return f"{source}: no usable prompts"


def encode_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """Each record's rendered prompt (``render_prompt``) as token ids, ``[]`` for a blank one
    (an empty prompt without chat turns). With a chat template the rendered text already holds
    the special tokens the template wants, so it is tokenised without adding more.

    A ``transformers`` tokenizer gets one call per run of consecutive rows rendered the same
    way (the same ids as a call per row, a third less time on a fast tokenizer); any other
    tokenizer is called once per prompt."""
    from transformers import PreTrainedTokenizerBase  # lazy: data loads without it

    batched = isinstance(tokenizer, PreTrainedTokenizerBase)
    out: list[list[int]] = [[] for _ in records]
    run: list[tuple[int, str]] = []
    run_templated = False

    def flush() -> None:
        if not run:
            return
        texts = [t for _, t in run]
        if batched:
            enc = tokenizer(texts, add_special_tokens=not run_templated).input_ids
        else:
            enc = [tokenizer(t, add_special_tokens=not run_templated).input_ids for t in texts]
        for (i, _), ids in zip(run, enc, strict=True):
            out[i] = list(ids)
        run.clear()

    for i, rec in enumerate(records):
        if not rec.prompt.strip() and not rec.extra.get("messages"):
            continue
        text, templated = render_prompt(rec, tokenizer, use_chat_template, system_prompt)
        if run and templated != run_templated:
            flush()
        run_templated = templated
        run.append((i, text))
    flush()
    return out


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    max_tokens: int,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> tuple[list[tuple[PromptRecord, list[int]]], SkipReport]:
    """Render (chat template) and tokenise each prompt once (``encode_prompts``, in chunks of
    ``TOKENIZE_BATCH``); skip blank ones and those over ``max_tokens`` tokens. Returns the
    kept (record, ids) pairs and the ``SkipReport``."""
    report = SkipReport(total=len(records), max_tokens=max_tokens)
    kept: list[tuple[PromptRecord, list[int]]] = []
    for lo in range(0, len(records), TOKENIZE_BATCH):
        chunk = records[lo : lo + TOKENIZE_BATCH]
        for rec, ids in zip(
            chunk, encode_prompts(chunk, tokenizer, use_chat_template, system_prompt), strict=True
        ):
            if report.note(rec, ids):
                kept.append((rec, ids))
    return kept, report

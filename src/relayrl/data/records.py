"""Dataset rows: a prompt to roll out (with its reference answer) and an SFT pair."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PromptRecord", "SFTRecord"]


@dataclass
class PromptRecord:
    """One RL prompt. ``answer`` is the reference for verifiable rewards; ``extra`` holds
    any other dataset fields (domain, difficulty, test cases, ...)."""

    prompt: str
    answer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_sample(self) -> dict[str, Any]:
        """The ``sample`` dict a reward function receives: extra fields, prompt, answer."""
        return {**self.extra, "prompt": self.prompt, "answer": self.answer}

    def to_dict(self) -> dict[str, Any]:
        """A flat JSON row (``prompt``, ``answer`` when set, then extra fields) that
        ``load_prompts_jsonl`` reads back into an equal record."""
        row: dict[str, Any] = {"prompt": self.prompt}
        if self.answer is not None:
            row["answer"] = self.answer
        row.update({k: v for k, v in self.extra.items() if k not in ("prompt", "answer")})
        return row


@dataclass
class SFTRecord:
    """One supervised pair: the model learns ``response`` given ``prompt``."""

    prompt: str
    response: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON row that ``load_sft_jsonl`` reads back into an equal record."""
        return {"prompt": self.prompt, "response": self.response}

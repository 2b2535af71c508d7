"""The ``data`` section: where prompts come from and how they are drawn."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import (
    KeyProblem,
    _Strict,
)


class ArithmeticConfig(_Strict):
    min_operand: int = 0
    """Inclusive operand range; negative operands are allowed (written ``(-3)``)."""
    max_operand: int = 99
    operators: list[str] = Field(default_factory=lambda: ["+"])
    num_operands: int = Field(2, ge=2)

    @model_validator(mode="after")
    def _range_not_empty(self) -> ArithmeticConfig:
        if self.max_operand < self.min_operand:
            raise KeyProblem(
                "max_operand",
                self.max_operand,
                f"must be >= min_operand ({self.min_operand})",
                related=("min_operand",),
            )
        return self


class PromptSourceConfig(_Strict):
    """How dataset rows become prompts (``relayrl.data.prompts.read`` and ``.template``)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    require_answer: bool = False
    """A row without ``answer_key`` is an error naming the row (verifiable rewards need it)."""
    split: str | None = None
    """Split of a saved ``DatasetDict`` (default ``train``)."""
    chat_template: bool = True
    """Apply the tokenizer's chat template when it has one."""
    system_prompt: str | None = None


class DynamicSamplingConfig(_Strict):
    """DAPO dynamic sampling: drop groups whose raw outcomes are all equal, refill."""

    enabled: bool = False
    max_rounds: int = Field(4, ge=1)
    """Generation rounds per step at most (round 0 is the normal batch)."""


class DataConfig(_Strict):
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    train_path: str | None = None
    """JSONL prompts (``prompt``, ``answer``, extra fields) when ``task: jsonl``."""
    eval_path: str | None = None
    """Held-out prompts (the first ``eval_size``). Unset: ``task: jsonl`` holds out
    ``eval_size`` seeded prompts of ``train_path``, never trained on (at most half of it);
    ``task: arithmetic`` uses a disjoint seeded stream."""
    eval_size: int = Field(200, ge=1)
    max_prompt_tokens: int = Field(128, ge=1)
    source: PromptSourceConfig = Field(default_factory=PromptSourceConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)

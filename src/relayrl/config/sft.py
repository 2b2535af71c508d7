"""The configuration of ``relayrl sft``: supervised fine-tuning on prompt/response pairs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import (
    KeyProblem,
    Seed,
    Threads,
    _Strict,
)
from relayrl.config.data import ArithmeticConfig


class SFTPromptFormat(_Strict):
    """How an SFT prompt is rendered: as ``relayrl train | eval`` render it (the same keys as
    their ``data.source``), so the model is trained in the format it is then asked in."""

    chat_template: bool = True
    """Apply the tokenizer's chat template when it has one (off: the raw prompt text)."""
    system_prompt: str | None = None
    """A system turn before each prompt (under a chat template only), as in RL."""


class SFTDataConfig(_Strict):
    source: SFTPromptFormat = Field(default_factory=SFTPromptFormat)
    """How prompts are rendered: the same keys as ``relayrl train``'s ``data.source``."""


class SFTConfig(_Strict):
    """Supervised fine-tuning on prompt/response pairs."""

    seed: Seed = 0
    threads: Threads = "auto"
    model_path: str = "runs/demo/base"
    output_dir: str = "runs/demo/sft"
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    train_path: str | None = None
    """JSONL with ``prompt`` and ``response`` when ``task: jsonl``."""
    num_examples: int = Field(20000, ge=1)
    steps: int = Field(1500, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear``: decay to 0 at the last step."""
    warmup_steps: int = Field(20, ge=0)
    eval_every: int = Field(0, ge=0)
    """Greedy pass rate on a validation set every N steps (0: never): the arithmetic task's
    validation stream, or ``val_path``."""
    val_path: str | None = None
    """JSONL validation prompts (``prompt``, ``answer``) scored by ``val_reward``."""
    val_reward: str = "arithmetic"
    eval_size: int = Field(200, ge=1)
    target_pass_rate: float | None = Field(None, ge=0, le=1)
    """Stop as soon as the validation pass rate reaches this (a warm start, not a full SFT);
    needs ``eval_every`` >= 1."""
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    progress: bool = True
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps and after the last one into ``output_dir/checkpoints`` (0:
    only the final model); ``relayrl sft --resume`` continues from the newest intact one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest SFT checkpoints kept (older ones are removed once a newer one is written)."""
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    """``data.source.chat_template`` / ``data.source.system_prompt``: the prompt format, the
    same keys (and defaults) as an RL run's; recorded in the output (``prompt_format.json``)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> SFTConfig:
        if self.target_pass_rate is not None and self.eval_every == 0:
            raise KeyProblem(
                "target_pass_rate",
                self.target_pass_rate,
                "needs eval_every >= 1 (the pass rate is only measured every eval_every steps)",
                related=("eval_every",),
            )
        return self

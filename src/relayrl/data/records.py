"""Dataset rows: a prompt to roll out (with its reference answer) and an SFT pair."""

from __future__ import annotations

from collections.abc import Sequence
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
        ``relayrl.data.prompts.load_prompts`` reads back into an equal record."""
        row: dict[str, Any] = {"prompt": self.prompt}
        if self.answer is not None:
            row["answer"] = self.answer
        row.update({k: v for k, v in self.extra.items() if k not in ("prompt", "answer")})
        return row


@dataclass
class SFTRecord:
    """One supervised pair: the model learns ``response`` given ``prompt``.

    ``segments`` (optional) splits ``response`` into ``(text, trained)`` pieces whose texts
    concatenate to it: a multi-turn trace marks the environment's observations (tool results
    and the next turn's header) ``trained=False`` so the SFT loss covers only the tokens the
    model writes, as an RL trajectory's loss mask does. ``None``: the whole response trains."""

    prompt: str
    response: str
    segments: tuple[tuple[str, bool], ...] | None = None

    def __post_init__(self) -> None:
        if self.segments is None:
            return
        self.segments = tuple((str(t), bool(m)) for t, m in self.segments)
        joined = "".join(t for t, _ in self.segments)
        if joined != self.response:
            raise ValueError(
                f"SFTRecord: the segments' texts join to {joined!r}, not the response "
                f"{self.response!r}"
            )

    @classmethod
    def from_segments(cls, prompt: str, segments: Sequence[tuple[str, bool]]) -> SFTRecord:
        """The record whose response is the segments' texts joined."""
        return cls(prompt, "".join(t for t, _ in segments), tuple(segments))

    def to_dict(self) -> dict[str, Any]:
        """A JSON row that ``load_sft_jsonl`` reads back into an equal record."""
        row: dict[str, Any] = {"prompt": self.prompt, "response": self.response}
        if self.segments is not None:
            row["segments"] = [{"text": t, "train": m} for t, m in self.segments]
        return row

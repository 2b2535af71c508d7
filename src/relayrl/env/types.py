"""The environment API's value types: messages, step results, typed errors, stop reasons.

A message is a plain dict ``{"role": ..., "content": ...}`` (OpenAI chat format; extra keys
such as ``"tool_calls"``, ``"name"`` or ``"tool_call_id"`` ride along). Roles: ``system``,
``user``, ``assistant``, ``tool``.

Two kinds of failure, never mixed:

- :class:`ToolError`: the model did something wrong (bad JSON in a tool call, an unknown
  tool, a tool that raised on its arguments). Its message is shown to the model as an
  observation and the episode goes on.
- :class:`EnvError` (and any other exception out of ``reset`` / ``step`` / ``close``, or a
  step past its timeout): the environment itself failed. The episode ends with stop reason
  ``env_error`` (or ``timeout``) as a recorded failure: its sample trains no token (loss
  mask all 0), it scores 0, it is counted in ``env/failures``, and the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Message = dict[str, Any]
"""One chat message: ``{"role": "user" | "assistant" | "system" | "tool", "content": str, ...}``."""

ROLES = ("system", "user", "assistant", "tool")

StopReason = Literal[
    "env_done",  # the environment said done
    "max_turns",  # env.max_turns assistant turns were generated
    "token_budget",  # env.max_total_tokens reached (prompt + all turns)
    "context_overflow",  # the next turn's context would not fit the engine's context
    "env_error",  # reset / step / close raised, or returned malformed messages
    "timeout",  # reset / step ran past env.step_timeout_s
    "abort",  # the engine aborted a turn (or rejected the request)
]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)


class ToolError(Exception):
    """A mistake of the model's (bad tool call, unknown tool, bad arguments): the message is
    shown to the model and the episode continues."""


class EnvError(Exception):
    """An infrastructure failure of the environment: the episode ends as a recorded failure
    (stop reason ``env_error``), never the step or the run."""


@dataclass
class StepResult:
    """What ``Environment.step`` returns.

    ``observation``: messages appended to the conversation (tool results, user feedback);
    ignored when ``done`` (the episode ends after the assistant's turn). ``reward``: an
    optional per-turn reward of the assistant turn just taken (``info`` is free-form and kept
    on the sample's ``metadata["env"]["infos"]``).
    """

    observation: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


def check_messages(messages: Any, where: str) -> list[Message]:
    """``messages`` as a list of well-formed messages, else :class:`EnvError` naming ``where``
    and the first bad entry (a role outside ``ROLES``, content that is not a string)."""
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list):
        raise EnvError(f"{where} returned {type(messages).__name__}, expected a list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EnvError(f"{where}: message {i} is {type(m).__name__}, expected a dict")
        if m.get("role") not in ROLES:
            raise EnvError(
                f"{where}: message {i} has role {m.get('role')!r}, expected one of {ROLES}"
            )
        if not isinstance(m.get("content"), str):
            raise EnvError(
                f"{where}: message {i} has content of type {type(m.get('content')).__name__}, "
                "expected str"
            )
    return messages


def as_step_result(value: Any, where: str) -> StepResult:
    """Normalise what a step returned: a ``StepResult``, a list of messages (not done), or a
    string (one ``user`` message, not done); anything else is an :class:`EnvError`."""
    if isinstance(value, StepResult):
        if not value.done:
            check_messages(value.observation, where)
        return value
    if isinstance(value, str):
        return StepResult([{"role": "user", "content": value}])
    if isinstance(value, (list, dict)):
        return StepResult(check_messages(value, where))
    raise EnvError(f"{where} returned {type(value).__name__}, expected a StepResult")

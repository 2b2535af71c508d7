"""The environment base class, and a way to write one from two functions.

An environment runs one episode at a time (per-episode state lives on the instance; a pool
reuses an instance for the next episode after ``reset``)::

    class Echo(Environment):
        async def reset(self, row):
            self.target = row["answer"]
            return [{"role": "user", "content": row["prompt"]}]

        async def step(self, message):
            done = self.target in message["content"]
            return StepResult([{"role": "user", "content": "try again"}], done=done)

or, with plain (sync or async) functions and a per-episode ``state`` dict::

    env = FunctionEnvironment(
        reset=lambda row, state: [{"role": "user", "content": row["prompt"]}],
        step=lambda message, state: StepResult(done=True),
    )

``reset`` gets the dataset row (``prompt``, ``answer`` and the row's extra fields) and returns
the first messages; ``step`` gets the assistant's message (``{"role": "assistant",
"content": text}``, plus ``"tool_calls"`` when the model called tools) and returns a
:class:`StepResult`; ``close`` releases what the environment holds (called once, when the pool
retires it). Exceptions other than :class:`ToolError` end the episode as a recorded failure.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from relayrl.env.types import Message, StepResult


class Environment:
    """Base class of an async environment (override ``reset`` and ``step``; ``close`` if it
    holds resources). ``tools``: the tool schemas shown to the model (``tools.tool_schema``),
    empty when the environment offers none."""

    tools: list[dict[str, Any]] = []

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        raise NotImplementedError

    async def step(self, message: Message) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None


async def call_maybe_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Await ``fn(*args)`` if it is a coroutine function (or returns an awaitable); a plain
    function runs in a worker thread, so a blocking one does not stall other episodes."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.to_thread(fn, *args)
    if inspect.isawaitable(out):
        out = await out
    return out


class FunctionEnvironment(Environment):
    """An environment from functions: ``reset(row, state) -> messages``,
    ``step(message, state) -> StepResult | messages | str`` and optionally
    ``close(state)``; each may be sync or async. ``state`` is a fresh dict per episode."""

    def __init__(
        self,
        reset: Callable[..., Any],
        step: Callable[..., Any],
        close: Callable[..., Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ):
        self._reset, self._step, self._close = reset, step, close
        self.tools = list(tools or [])
        self.state: dict[str, Any] = {}

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.state = {}
        return await call_maybe_async(self._reset, row, self.state)

    async def step(self, message: Message) -> StepResult:
        return await call_maybe_async(self._step, message, self.state)

    async def close(self) -> None:
        if self._close is not None:
            await call_maybe_async(self._close, self.state)

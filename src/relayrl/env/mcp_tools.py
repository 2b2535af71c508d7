"""MCP tools: a Model Context Protocol server's tools offered to the model.

``MCPToolEnvironment(command)`` starts a local MCP server over stdio (``command``: the server's
argv, e.g. ``["python", "server.py"]``) with the official ``mcp`` package (PyPI ``mcp``, 2.x),
lists its tools and offers them to the model as OpenAI function schemas (the tool's
``inputSchema`` as the parameters; a chat template renders them through its ``tools``). Each
assistant turn's ``<tool_call>`` blocks are called through the MCP client, in order, and answered
as ``tool`` messages; a turn without a call is the final answer (done), as in
:class:`~relayrl.env.tools.ToolEnvironment`, whose parsing and error rules it shares:

- a call the server rejects (``isError``: bad arguments, the tool raised) or an unknown tool
  is the model's mistake: ``error: ...`` shown to it, the episode goes on;
- a server that cannot start, dies, or does not answer within ``call_timeout_s`` is an
  infrastructure failure (:class:`~relayrl.env.types.EnvError`): the episode ends
  ``env_error`` and the environment is closed, not reused.

One server process per environment, started at its first ``reset`` and kept across the
episodes the pool reuses it for; ``close`` stops it. The client lives in one task of its own
(the MCP client's task groups must be entered and left by the same task); ``reset`` / ``step``
hand it requests. Config: ``env.factory: mcp`` with ``env.kwargs: {command: [python,
server.py], system_prompt: ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relayrl.env.tools import ToolCall, ToolEnvironment, Toolset
from relayrl.env.types import EnvError, Message, StepResult, ToolError


def _schema(tool: Any) -> dict[str, Any]:
    params = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {}
    params = {k: v for k, v in dict(params).items() if k != "title"}
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": params or {"type": "object", "properties": {}},
        },
    }


def _text(result: Any) -> str:
    parts = [getattr(c, "text", None) for c in getattr(result, "content", None) or []]
    return "\n".join(p for p in parts if p is not None)


class MCPServerProcess:
    """A stdio MCP server and its client, driven by one task (see module)."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 30.0,
    ):
        if not command:
            raise ValueError("an MCP server needs a command (argv)")
        self.command, self.env, self.cwd, self.timeout_s = list(command), env, cwd, timeout_s
        self.tools: list[Any] = []
        self._requests: asyncio.Queue[tuple[str, dict[str, Any], asyncio.Future[Any]]] | None
        self._requests = None
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._requests = asyncio.Queue()
        self._ready = loop.create_future()
        self._task = asyncio.create_task(self._serve())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.timeout_s)
        except TimeoutError:
            await self.stop()
            raise EnvError(
                f"the MCP server {self.command} did not start in {self.timeout_s:g} s"
            ) from None

    async def _serve(self) -> None:
        from mcp import Client, StdioServerParameters  # PyPI mcp (2.x)

        assert self._ready is not None and self._requests is not None
        params = StdioServerParameters(
            command=self.command[0],
            args=self.command[1:],
            env=dict(self.env or {}) or None,
            cwd=self.cwd,
        )
        try:
            async with Client(params) as client:
                self.tools = list((await client.list_tools()).tools)
                self._ready.set_result(None)
                while True:
                    name, args, fut = await self._requests.get()
                    if not name:
                        return
                    try:
                        fut.set_result(await client.call_tool(name, args))
                    except Exception as e:  # noqa: BLE001  (handed to the caller)
                        if not fut.done():
                            fut.set_exception(e)
        except Exception as e:  # noqa: BLE001  (start-up or transport failure)
            if not self._ready.done():
                self._ready.set_exception(EnvError(f"the MCP server {self.command} failed: {e}"))

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        if self._task is None or self._task.done() or self._requests is None:
            raise EnvError(f"the MCP server {self.command} is not running")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._requests.put((name, arguments, fut))
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise EnvError(
                f"the MCP tool {name!r} did not answer in {self.timeout_s:g} s"
            ) from None
        except EnvError:
            raise
        except Exception as e:  # the transport broke: the environment's failure
            raise EnvError(f"the MCP call {name!r} failed: {type(e).__name__}: {e}") from None

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self._requests is not None and not task.done():
            await self._requests.put(("", {}, asyncio.get_running_loop().create_future()))
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), self.timeout_s)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class MCPToolset(Toolset):
    """The server's tools as a :class:`Toolset` (calls go through the MCP client)."""

    def __init__(self, server: MCPServerProcess):
        self.server = server
        self.functions = {t.name: _no_local_call for t in server.tools}
        self.schemas = [_schema(t) for t in server.tools]

    async def call(self, call: ToolCall) -> str:
        if call.name not in self.functions:
            raise ToolError(f"unknown tool {call.name!r} (tools: {', '.join(self.functions)})")
        result = await self.server.call(call.name, call.arguments)
        text = _text(result)
        if getattr(result, "is_error", None) or getattr(result, "isError", None):
            raise ToolError(f"{call.name} failed: {text}")
        return text


def _no_local_call(**_: Any) -> None:  # pragma: no cover - MCP tools run on the server
    raise RuntimeError("an MCP tool runs on its server")


class MCPToolEnvironment(ToolEnvironment):
    """A tool task whose tools are a stdio MCP server's (see module)."""

    def __init__(
        self,
        command: Sequence[str],
        system_prompt: str | None = None,
        format_prompt: Callable[[Mapping[str, Any]], str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        call_timeout_s: float = 30.0,
    ):
        super().__init__([], system_prompt, format_prompt)
        self.server = MCPServerProcess(command, env, cwd, call_timeout_s)
        self._started = False

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        if not self._started:
            await self.server.start()
            self._started = True
            self.toolset = MCPToolset(self.server)
            self.tools = self.toolset.schemas
        return await super().reset(row)

    async def step(self, message: Message) -> StepResult:
        return await super().step(message)

    async def close(self) -> None:
        await self.server.stop()


def make_mcp_env(
    command: Sequence[str],
    system_prompt: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    call_timeout_s: float = 30.0,
) -> MCPToolEnvironment:
    """``env.factory: mcp`` (``env.kwargs``: ``command``, ``system_prompt``, ``env``, ``cwd``,
    ``call_timeout_s``)."""
    return MCPToolEnvironment(command, system_prompt, None, env, cwd, call_timeout_s)

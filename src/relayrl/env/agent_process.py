"""Agents in worker processes (``env.agent.isolation: process``): killed past their timeout.

``ProcessAgent(agent)`` runs each rollout's agent function (sync or async; picklable: a
module-level function, as ``env.agent.function``'s ``"module:function"`` names one) in a fresh
spawned process and hands back what it returned. When the rollout is cancelled (past
``env.agent.timeout_s``) the process is killed at once: an agent stuck in a loop or a blocking
call stops using the machine, unlike a thread, which can only be abandoned. An exception in
the agent comes back with its type and message. Cost: one Python start-up per rollout.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def _run(conn: Any, agent: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        out = agent(*args)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        conn.send(("error", f"{type(e).__name__}: {e}"))


async def _awaited(aw: Any) -> Any:
    return await aw


class AgentProcessError(RuntimeError):
    """The agent raised in its worker process (its type and message), or the worker died."""


class ProcessAgent:
    """An agent function run in a worker process per rollout (see module)."""

    def __init__(self, agent: Callable[..., Any]):
        self.agent = agent
        self.pids: list[int] = []  # the workers started (tests check they are gone)

    async def __call__(self, base_url: str, api_key: str, row: dict[str, Any]) -> Any:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_run, args=(child, self.agent, (base_url, api_key, row)), daemon=True
        )
        proc.start()
        child.close()
        self.pids.append(int(proc.pid or 0))
        try:
            status, value = await asyncio.to_thread(_receive, parent)
        except BaseException:  # cancelled (the rollout's timeout): the worker goes at once
            proc.kill()
            proc.join(5)
            parent.close()
            raise
        parent.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if status != "ok":
            raise AgentProcessError(value)
        return value


def _receive(conn: Any) -> tuple[str, Any]:
    try:
        return conn.recv()
    except EOFError:
        return "error", "the agent's worker process died without an answer"

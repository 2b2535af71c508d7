"""Environments in worker processes (``env.isolation: process``): killed past their timeout.

``ProcessEnvironment(factory)`` starts a worker process (``spawn``: a fresh interpreter, the
factory pickled over, so it must be importable: ``env.factory``'s ``"module:callable"`` is),
builds the environment there and forwards ``reset`` / ``step`` / ``close`` over a pipe; the
environment's ``tools`` come back at start. A call the pool gives up on (past
``step_timeout_s``: blocking code, an infinite loop, a hung C extension) ends its episode
``timeout`` as with threads, and the environment, never reused after a failure, is closed:
the worker is killed (SIGKILL after a short grace), so nothing of it runs on; the pool makes
a fresh one for the next episode. Exceptions raised in the worker come back as the episode's
failure (their type and message); a worker that dies is an ``EnvError``.

Cost: one process per environment (a Python start-up each, then a pipe round trip per call);
``reuse`` keeps a healthy worker across episodes.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from relayrl.env.environment import Environment
from relayrl.env.types import EnvError, Message, StepResult, ToolError


def _serve(conn: Any, factory: Callable[[], Environment]) -> None:
    """The worker: build the environment, then answer (method, argument) requests."""
    loop = asyncio.new_event_loop()
    try:
        env = factory()
        conn.send(("ok", list(getattr(env, "tools", None) or [])))
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))
        return
    while True:
        try:
            method, arg = conn.recv()
        except EOFError:
            return
        try:
            if method == "close":
                loop.run_until_complete(env.close())
                conn.send(("ok", None))
                return
            fn = env.reset if method == "reset" else env.step
            conn.send(("ok", loop.run_until_complete(fn(arg))))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", (type(e).__name__, str(e), traceback.format_exc())))


class ProcessEnvironment(Environment):
    """An environment living in a worker process (see module)."""

    def __init__(self, factory: Callable[[], Environment], start_timeout_s: float = 60.0):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory), daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise EnvError(f"the environment's worker did not start in {start_timeout_s:g} s")
        self.tools = self._answer(self._conn.recv(), "creating the environment")
        self._busy = False

    def _answer(self, reply: tuple[str, Any], what: str) -> Any:
        status, value = reply
        if status == "ok":
            return value
        name, msg, _tb = value
        if name == "ToolError":
            raise ToolError(msg)
        raise EnvError(f"{what} raised {name}: {msg}")

    async def _call(self, method: str, arg: Any) -> Any:
        def roundtrip() -> tuple[str, Any]:
            self._conn.send((method, arg))
            return self._conn.recv()

        self._busy = True
        try:
            reply = await asyncio.to_thread(roundtrip)
            self._busy = False
        except (EOFError, OSError, BrokenPipeError) as e:
            code = self.process.exitcode
            raise EnvError(f"the environment's worker died (exit code {code}): {e!r}") from None
        return self._answer(reply, method)

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        return await self._call("reset", dict(row))

    async def step(self, message: Message) -> StepResult:
        return await self._call("step", message)

    async def close(self) -> None:
        """Close the environment in its worker (briefly), then make sure the worker is gone."""
        if self.process.is_alive() and not self._busy:  # a call still running: killed
            try:
                await asyncio.wait_for(self._call("close", None), 2.0)
            except BaseException:  # noqa: BLE001  (busy or hung: killed below)
                pass
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self._conn.close()


def in_processes(factory: Callable[[], Environment]) -> Callable[[], ProcessEnvironment]:
    """A factory of :class:`ProcessEnvironment` s over ``factory`` (picklable)."""
    return _ProcessFactory(factory)


class _ProcessFactory:
    def __init__(self, factory: Callable[[], Environment]):
        self.factory = factory

    def __call__(self) -> ProcessEnvironment:
        return ProcessEnvironment(self.factory)

"""The environment pool and the asyncio loop environments run in.

``EnvLoop``: one asyncio event loop in a daemon thread. Every ``reset`` / ``step`` / ``close``
runs there, off the generation path: while an episode waits on its environment the engine
keeps generating for the others (sync functions inside an environment should go through
``asyncio.to_thread``; ``FunctionEnvironment`` and the tools do so). The loop's executor runs
each such call in a daemon thread of its own: a sync call that hangs past its timeout is
abandoned (its episode ends ``timeout``) and never holds up the process's exit.

``EnvPool``: creates environments from the factory, hands one to each episode (at most
``concurrency`` at once; the others wait), takes it back when the episode ends: a healthy one
is reused for the next episode (``reuse``; ``reset`` re-initialises it), a failed or timed-out
one is closed and never reused. Every call is bounded by ``timeout_s``; ``close`` always runs
(a failing ``close`` is counted in ``close_failures``, never raised into an episode).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from relayrl.env.environment import Environment, call_maybe_async
from relayrl.env.types import EnvError

T = TypeVar("T")


class DaemonThreadExecutor(ThreadPoolExecutor):
    """Runs every call in a new daemon thread (see module; a ThreadPoolExecutor in type only,
    as asyncio requires of a default executor)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
                fut.set_exception(e)

        threading.Thread(target=run, name="relayrl-env-call", daemon=True).start()
        return fut


class EnvLoop:
    """An asyncio event loop running in its own daemon thread."""

    def __init__(self, name: str = "relayrl-env-loop"):
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(DaemonThreadExecutor())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread)."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop (episodes cut short by the run's end: their
        environment calls are awaited to their cancellation, so asyncio reports no task
        destroyed while pending), then stop the loop and its thread."""
        if self.loop.is_closed():
            return
        if threading.current_thread() is not self._thread and self.loop.is_running():
            try:
                self.run(_cancel_pending(), timeout=5)
            except Exception:  # noqa: BLE001  (stopping must not mask the run's own error)
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_pending() -> None:
    me = asyncio.current_task()
    pending = [t for t in asyncio.all_tasks() if t is not me]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def bounded(awaitable: Awaitable[T], timeout_s: float, what: str) -> T:
    """``awaitable`` within ``timeout_s`` seconds, else ``asyncio.TimeoutError`` naming ``what``."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} took longer than {timeout_s:g} s") from None


class EnvPool:
    """Create / reuse / close environments, at most ``concurrency`` in use (see module).

    Runs on an ``EnvLoop`` (all methods are coroutines of that loop)."""

    def __init__(
        self,
        factory: Callable[[], Environment | Awaitable[Environment]],
        concurrency: int = 64,
        reuse: bool = True,
        timeout_s: float = 30.0,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.factory = factory
        self.concurrency = concurrency
        self.reuse = reuse
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()
        self._idle: list[Environment] = []
        self._in_use: set[int] = set()
        self._sem: asyncio.Semaphore | None = None  # made on the loop that uses it

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.concurrency)
        return self._sem

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    async def acquire(self) -> Environment:
        """An environment for one episode (waits while ``concurrency`` are in use). A factory
        that raises or returns something else is an :class:`EnvError`."""
        await self._semaphore().acquire()
        try:
            if self._idle:
                env = self._idle.pop()
                self.counters["reused"] += 1
            else:
                env = await bounded(
                    call_maybe_async(self.factory), self.timeout_s, "creating the environment"
                )
                if not isinstance(env, Environment):
                    raise EnvError(
                        f"the env factory returned {type(env).__name__}, not an Environment"
                    )
                self.counters["created"] += 1
        except BaseException:
            self._semaphore().release()
            raise
        self._in_use.add(id(env))
        return env

    async def release(self, env: Environment, healthy: bool) -> None:
        """Give ``env`` back: reused when healthy (and ``reuse``), else closed. Never raises."""
        if id(env) not in self._in_use:
            return
        self._in_use.discard(id(env))
        try:
            if healthy and self.reuse:
                self._idle.append(env)
            else:
                await self._close(env)
        finally:
            self._semaphore().release()

    async def _close(self, env: Environment) -> None:
        try:
            await bounded(env.close(), self.timeout_s, "close")
            self.counters["closed"] += 1
        except BaseException as e:  # noqa: BLE001  (close must never fail an episode or a run)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.counters["close_failures"] += 1

    async def close(self) -> None:
        """Close every idle environment (those in use are closed when released)."""
        idle, self._idle = self._idle, []
        for env in idle:
            await self._close(env)

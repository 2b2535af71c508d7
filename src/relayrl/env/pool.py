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

Isolation (``isolate``, the default): each environment lives on an event loop of its own, in
a daemon thread (made with it: the factory, ``reset``, ``step`` and ``close`` all run there), and
the pool awaits each call from the shared loop with its timeout. So blocking code inside an
``async def step`` (a ``time.sleep``, a blocking client) stalls only its own environment: the
call ends ``timeout`` at ``timeout_s`` while every other episode goes on, and the pool names
the cause when the environment's loop does not answer (``blocked``: "its event loop was
blocked"). Such an environment is abandoned: its thread is left to finish on its own (a
daemon: it never holds up the process's exit) and counted in ``abandoned``. ``close()`` at the
end of a run closes every environment, idle or still in an episode.
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

    async def responsive(self, within_s: float = 0.2) -> bool:
        """Whether this loop runs a no-op within ``within_s`` (awaited from another loop):
        False when code on it blocks."""
        fut = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop))
        try:
            await asyncio.wait_for(fut, within_s)
            return True
        except TimeoutError:
            return False

    def abandon(self) -> None:
        """Stop the loop once what blocks it returns, without waiting (its thread is a
        daemon)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)

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
        isolate: bool = True,
    ):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.factory = factory
        self.concurrency = concurrency
        self.reuse = reuse
        self.timeout_s = timeout_s
        self.isolate = isolate
        self.counters: Counter[str] = Counter()
        self._idle: list[Environment] = []
        self._in_use: dict[int, Environment] = {}
        self._loops: dict[int, EnvLoop] = {}  # id(env) -> its own loop (isolate)
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
                env = await self._create()
        except BaseException:
            self._semaphore().release()
            raise
        self._in_use[id(env)] = env
        return env

    async def _create(self) -> Environment:
        what = "creating the environment"
        if not self.isolate:
            env = await bounded(call_maybe_async(self.factory), self.timeout_s, what)
        else:
            loop = EnvLoop("relayrl-env")
            try:
                env = await self._on(loop, lambda: call_maybe_async(self.factory), what)
            except BaseException:
                loop.abandon()
                self.counters["abandoned"] += 1
                raise
            if isinstance(env, Environment):
                self._loops[id(env)] = loop
            else:
                loop.abandon()
        if not isinstance(env, Environment):
            raise EnvError(f"the env factory returned {type(env).__name__}, not an Environment")
        self.counters["created"] += 1
        return env

    async def _on(self, loop: EnvLoop, fn: Callable[[], Awaitable[T]], what: str) -> T:
        """``fn()`` run on ``loop``, awaited here within ``timeout_s`` (a blocked loop named)."""

        async def run() -> T:
            return await fn()

        fut = asyncio.wrap_future(loop.submit(run()))
        try:
            return await bounded(fut, self.timeout_s, what)
        except TimeoutError as e:
            if not await loop.responsive():
                self.counters["blocked"] += 1
                raise TimeoutError(
                    f"{e}: its event loop was blocked (blocking code inside an async method: "
                    "run it with asyncio.to_thread)"
                ) from None
            raise

    async def call(self, env: Environment, fn: Callable[[], Awaitable[T]], what: str) -> T:
        """``fn()`` (a call of ``env``'s) on the environment's own loop, within ``timeout_s``."""
        loop = self._loops.get(id(env))
        if loop is None:
            return await bounded(fn(), self.timeout_s, what)
        return await self._on(loop, fn, what)

    async def release(self, env: Environment, healthy: bool) -> None:
        """Give ``env`` back: reused when healthy (and ``reuse``), else closed. Never raises."""
        if id(env) not in self._in_use:
            return
        del self._in_use[id(env)]
        try:
            if healthy and self.reuse:
                self._idle.append(env)
            else:
                await self._close(env)
        finally:
            self._semaphore().release()

    async def _close(self, env: Environment) -> None:
        blocked = False
        try:
            await self.call(env, env.close, "close")
            self.counters["closed"] += 1
        except BaseException as e:  # noqa: BLE001  (close must never fail an episode or a run)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.counters["close_failures"] += 1
            blocked = isinstance(e, TimeoutError)
        loop = self._loops.pop(id(env), None)
        if loop is not None:
            if blocked and not await loop.responsive():
                self.counters["abandoned"] += 1
                loop.abandon()
            else:
                await asyncio.to_thread(loop.stop)

    async def close(self) -> None:
        """Close every environment: the idle ones and those still in an episode (the run is
        ending: an in-flight episode's environment would otherwise leak)."""
        envs, self._idle = [*self._idle, *self._in_use.values()], []
        self._in_use.clear()
        await asyncio.gather(*(self._close(env) for env in envs))

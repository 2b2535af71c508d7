"""One owner thread for an engine that several threads (HTTP handlers, agents) share.

The rollout engines are single-threaded (``RolloutEngine``: ``submit`` / ``step`` /
``update_weights`` from one thread). :class:`EngineOwner` is that one thread: callers hand it
requests (``generate(request) -> Future[Sample]``) or work on the engine
(``call(fn) -> fn(engine)``, e.g. a weight update or a stats read), and the owner thread does
everything that touches the engine, in order:

1. run queued calls and submit queued requests (a request the engine rejects fails its
   future with the engine's ``InvalidRequestError``; nothing else is disturbed);
2. advance the engine: ``engine.step()`` for a stepping engine (the in-process
   ``RolloutEngine`` / ``VllmEngine``), or ``engine.poll(timeout)`` for a polling client (the
   ``EngineProcess`` client of an engine in its own process: requests are tagged with a ticket
   in their metadata, and requests the worker rejects come back through ``rejected()``);
3. resolve the futures of the samples that finished.

Versions are the engine's: the owner hands back the engine's own ``Sample`` (per-token ids,
behaviour logprobs and the versions the engine stamped), untouched.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from relayrl.rollout.types import GenerationRequest, Sample

T = TypeVar("T")
TICKET = "_agent_ticket"
"""Metadata key of a request's ticket on a polling engine (removed from the returned sample)."""


class EngineClosed(RuntimeError):
    """The engine owner was closed (or its thread died) before the request finished."""


class EngineOwner:
    """The one thread that drives ``engine`` (see module).

    Args:
        engine: a stepping engine (``submit`` -> id, ``step`` -> finished samples,
            ``has_unfinished``) or a polling client (``submit_many``, ``poll(timeout)``,
            ``rejected()``).
        idle_wait_s: how long the thread sleeps on its inbox when the engine has no work.
    """

    def __init__(self, engine: Any, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.polling = hasattr(engine, "poll") and not hasattr(engine, "step")
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[tuple[str, Any, Future[Any]]] = queue.Queue()
        self._pending: dict[int, Future[Sample]] = {}
        self._tickets = itertools.count()
        self._closed = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-owner", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    @property
    def max_model_len(self) -> int | None:
        """The engine's context length, when it says (prompt + completion tokens)."""
        value = getattr(self.engine, "max_model_len", None)
        return int(value) if value is not None else None

    def generate(self, request: GenerationRequest) -> Future[Sample]:
        """Queue ``request``; the future gets the engine's sample (or its rejection error)."""
        fut: Future[Sample] = Future()
        self._put("generate", request, fut)
        return fut

    def call(self, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """Run ``fn(engine)`` on the owner thread between engine steps; return its result."""
        fut: Future[T] = Future()
        self._put("call", fn, fut)
        return fut.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; unfinished requests fail with :class:`EngineClosed`."""
        self._closed.set()
        self._inbox.put(("wake", None, Future()))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> EngineOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, kind: str, payload: Any, fut: Future[Any]) -> None:
        if self._closed.is_set():
            raise EngineClosed(f"the engine owner is closed{self._why()}")
        self._inbox.put((kind, payload, fut))

    def _why(self) -> str:
        return f" ({type(self.error).__name__}: {self.error})" if self.error else ""

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._take_inbox(block=not self._pending)
                if self._pending:
                    self._advance()
        except BaseException as exc:  # the engine died: every waiter hears it
            self.error = exc
        finally:
            self._closed.set()
            self._fail_all()

    def _take_inbox(self, block: bool) -> None:
        items = []
        try:
            items.append(
                self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
            )
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for kind, payload, fut in items:
            if kind == "call":
                try:
                    fut.set_result(payload(self.engine))
                except Exception as exc:
                    fut.set_exception(exc)
            elif kind == "generate":
                self._submit(payload, fut)

    def _submit(self, request: GenerationRequest, fut: Future[Sample]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self.polling:
            ticket = next(self._tickets)
            tagged = GenerationRequest(
                request.prompt_ids,
                request.params,
                request.group_id,
                {**request.metadata, TICKET: ticket},
            )
            self._pending[ticket] = fut
            self.engine.submit_many([tagged])
            return
        try:
            rid = self.engine.submit(request)
        except ValueError as exc:  # InvalidRequestError: this request only
            fut.set_exception(exc)
            return
        self._pending[int(rid)] = fut

    def _advance(self) -> None:
        if self.polling:
            for meta, error in self.engine.rejected():
                fut = self._pending.pop(int(meta.get(TICKET, -1)), None)
                if fut is not None:
                    fut.set_exception(ValueError(error))
            for s in self.engine.poll(timeout=0.01):
                ticket = s.metadata.pop(TICKET, None)
                fut = self._pending.pop(int(ticket), None) if ticket is not None else None
                if fut is not None:
                    fut.set_result(s)
            return
        for s in self.engine.step():
            fut = self._pending.pop(s.request_id, None)
            if fut is not None:
                fut.set_result(s)

    def _fail_all(self) -> None:
        err = EngineClosed(f"the engine owner stopped before the request finished{self._why()}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        while True:
            try:
                _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(err)

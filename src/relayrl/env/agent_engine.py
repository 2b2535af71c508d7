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
   in their metadata, and requests the worker rejects come back through ``rejected()``; a
   client with ``submit_live`` gets each request under its ticket as the live key);
3. hand streamed requests their new tokens; show the samples that finished to the observers,
   then resolve their futures.

Streaming (``generate(request, on_tokens=sink)``): the sink is called on this thread, first
with empty lists once the engine has accepted the request, then after every step with the
tokens the request gained, as ``(ids, behaviour logprobs, versions)`` (and their alternatives
for a request with ``top_logprobs``; a server-process vLLM streams none), read with the engine's
``progress(request_id, start)`` (the in-process engines; the engine-process client's
``progress(ticket, start)``, which reads what its worker sent after each of its steps), and
last with whatever the finished sample adds, before its future resolves: the concatenated
deltas are the sample's response. On the engine-process client the acceptance call comes once
the worker accepted the request (its first ``progress`` that is not None). A polling client
without ``submit_live`` (Ray replicas) hands the tokens over at the finish only (and makes no
acceptance call). Nothing of this runs for requests without a sink: the engine's step is the
same. ``abort(future)`` stops a request (``engine.abort``, by request id or, on the
engine-process client, by ticket): its future gets the ``'abort'`` sample; a polling client
without ``submit_live`` has no abort (its request runs to its end).

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

from relayrl.rollout.backend import LivePollingBackend, PollingBackend, SteppingEngine
from relayrl.rollout.types import GenerationRequest, Sample

T = TypeVar("T")
TokenSink = Callable[..., None]
"""Receives a streamed request's new tokens (ids, logprobs, versions, and the alternatives of a
request that asked for ``top_logprobs``); quick, never raises."""
TICKET = "_agent_ticket"
"""Metadata key of a request's ticket on a polling engine (removed from the returned sample)."""


class EngineClosed(RuntimeError):
    """The engine owner was closed (or its thread died) before the request finished."""


class EngineOwner:
    """The one thread that drives ``engine`` (see module).

    Args:
        engine: a :class:`~relayrl.rollout.SteppingEngine` (``submit`` -> id, ``step`` ->
            finished samples, ``progress``, ``abort``) or a
            :class:`~relayrl.rollout.PollingBackend` (``submit_many``, ``poll(timeout)``,
            ``rejected()``).
        idle_wait_s: how long the thread sleeps on its inbox when the engine has no work.
    """

    def __init__(self, engine: SteppingEngine | PollingBackend, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._poller = engine if isinstance(engine, PollingBackend) else None
        self._stepper = None if isinstance(engine, PollingBackend) else engine
        # a polling client that streams and aborts by ticket (the engine-process client)
        self._live = engine if isinstance(engine, LivePollingBackend) else None
        self.polling = self._poller is not None
        self.live = self._live is not None
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[tuple[str, Any, Future[Any]]] = queue.Queue()
        self._pending: dict[int, Future[Sample]] = {}
        # key -> (sink, [tokens sent, accepted (the empty call was made)])
        self._streams: dict[int, tuple[TokenSink, list[int]]] = {}
        self.observers: list[Callable[[Sample], None]] = []
        self.aborts_requested = 0  # abort() calls on unfinished requests
        self._tickets = itertools.count()
        self._closed = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-owner", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    @property
    def closed(self) -> bool:
        """Closed, or its thread died: no request will be served any more."""
        return self._closed.is_set()

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length, when it says (prompt + completion tokens)."""
        value = self.engine.max_model_len
        return int(value) if value is not None else None

    def generate(
        self, request: GenerationRequest, on_tokens: TokenSink | None = None
    ) -> Future[Sample]:
        """Queue ``request``; the future gets the engine's sample (or its rejection error).
        ``on_tokens``: stream its tokens as they are generated (see module)."""
        fut: Future[Sample] = Future()
        self._put("generate", (request, on_tokens), fut)
        return fut

    def abort(self, fut: Future[Sample]) -> None:
        """Stop the request of ``fut`` (from ``generate``): not yet submitted, it is dropped
        (the future is cancelled); running, the engine aborts it and the future gets the
        ``'abort'`` sample with the tokens so far. A finished request is left alone."""
        if fut.done() or self._closed.is_set():
            return
        self.aborts_requested += 1
        if not fut.cancel():
            self._inbox.put(("abort", fut, Future()))

    def observe(self, fn: Callable[[Sample], None]) -> None:
        """Call ``fn(sample)`` on the owner thread for every sample the engine hands back,
        before its stream's last tokens and its future (to know when a request finished)."""
        self.observers.append(fn)

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
                request, sink = payload
                self._submit(request, sink, fut)
            elif kind == "abort":
                key = next((k for k, f in self._pending.items() if f is payload), None)
                if key is not None and self._stepper is not None:
                    self._stepper.abort(key)
                elif key is not None and self._live is not None:
                    self._live.abort(key)

    def _submit(
        self, request: GenerationRequest, sink: TokenSink | None, fut: Future[Sample]
    ) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self._poller is not None:
            ticket = next(self._tickets)
            tagged = GenerationRequest(
                request.prompt_ids,
                request.params,
                request.group_id,
                {**request.metadata, TICKET: ticket},
            )
            self._pending[ticket] = fut
            if sink is not None:
                self._streams[ticket] = (sink, [0, 0])
            if self._live is not None:
                self._live.submit_live(tagged, ticket, stream=sink is not None)
            else:
                self._poller.submit_many([tagged])
            return
        assert self._stepper is not None
        try:
            rid = self._stepper.submit(request)
        except ValueError as exc:  # InvalidRequestError: this request only
            fut.set_exception(exc)
            return
        self._pending[int(rid)] = fut
        if sink is not None:
            self._streams[int(rid)] = (sink, [0, 1])
            sink([], [], [])  # accepted

    def _advance(self) -> None:
        if self._poller is not None:
            for req, error in self._poller.rejected():
                self._streams.pop(int(req.metadata.get(TICKET, -1)), None)
                fut = self._pending.pop(int(req.metadata.get(TICKET, -1)), None)
                if fut is not None:
                    fut.set_exception(ValueError(error))
            for s in self._poller.poll(timeout=0.01):
                ticket = s.metadata.pop(TICKET, None)
                if ticket is not None:
                    self._finish(int(ticket), s)
        else:
            assert self._stepper is not None
            for s in self._stepper.step():
                self._finish(s.request_id, s)
        source = self._stepper if self._stepper is not None else self._live
        if source is None:  # a polling client without streaming: tokens come at the finish
            return
        for key, (sink, sent) in self._streams.items():
            new = source.progress(key, sent[0])
            if new is None or not (new[0] or not sent[1]):
                continue
            sent[0] += len(new[0])
            sent[1] = 1  # accepted: the first call (maybe with no tokens yet)
            sink(*new)

    def _finish(self, key: int, s: Sample) -> None:
        """Show a finished sample to the observers, hand its last tokens to its sink, then
        resolve its future."""
        for fn in self.observers:
            fn(s)
        stream = self._streams.pop(key, None)
        if stream is not None:
            sink, sent = stream
            k = sent[0]
            if len(s.response_ids) > k:
                top = () if s.top_logprobs is None else (s.top_logprobs[k:],)
                sink(s.response_ids[k:], s.behaviour_logprobs[k:], s.versions[k:], *top)
        fut = self._pending.pop(key, None)
        if fut is not None:
            fut.set_result(s)

    def _fail_all(self) -> None:
        err = EngineClosed(f"the engine owner stopped before the request finished{self._why()}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._streams.clear()
        while True:
            try:
                _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(err)

"""Streaming and abort for requests of an engine in its own process (:mod:`.engine_process`).

The in-process engines stream through ``progress(request_id, start)`` (a running request's
tokens from index ``start`` on, as ``(ids, behaviour logprobs, versions)``, or None) and stop a
request with ``abort(request_id)``. The engine-process client offers the same two calls keyed
by a caller's ``key`` instead of the worker's request id: a request submitted with
``EngineProcess.submit_live(request, key, stream)`` carries ``key`` in its metadata
(``LIVE_TAG``; ``STREAM_TAG`` when its tokens are streamed), and

- the worker (:class:`WorkerStreams`) remembers ``key -> request id`` until the request's
  sample leaves; once it accepted a streamed request it sends ``(key, [], [], [])``, and after
  every engine step ``(key, ids, logprobs, versions)`` with the tokens each streamed request
  gained since the last message (read with the engine's own ``progress``; an engine without
  it sends nothing more: the tokens come with the sample), and for a request that asked for
  ``top_logprobs`` a fifth element, those tokens' alternatives (the fourth element of the
  engine's ``progress``); a request that did not ask sends the four elements, as before. An
  ``("abort", keys)`` command calls the engine's ``abort`` on those requests: their
  ``'abort'`` samples (tokens so far) come out of the next step and the slots are free.
- the client (:class:`ClientStreams`) appends those messages per key on its receiver thread;
  ``progress(key, start)`` reads them, with the alternatives as a fourth element once the
  worker sent some (None before the worker accepted the request and after its sample arrived;
  the caller then takes the rest from the sample, which holds every token and alternative).

Messages are one per engine step for all streamed requests together; requests submitted
without ``submit_live`` cost nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

from relayrl.rollout.backend import SteppingEngine
from relayrl.rollout.types import GenerationRequest, Sample

T = TypeVar("T")

LIVE_TAG = "_live_key"
"""Metadata key of a live request's key (removed from its sample by the client)."""
STREAM_TAG = "_live_stream"
"""Metadata key: the live request's tokens are streamed (removed from its sample)."""


def drain_queue(q: queue.Queue[T], timeout: float) -> list[T]:
    """Everything in ``q`` now, waiting up to ``timeout`` seconds for the first item."""
    out: list[T] = []
    try:
        out.append(q.get(timeout=timeout) if timeout > 0 else q.get_nowait())
    except queue.Empty:
        return out
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


Progress = tuple[Any, ...]
"""(ids, behaviour logprobs, versions), and the alternatives of a ``top_logprobs`` request."""
Update = tuple[Any, ...]
"""(key, ids, logprobs, versions), and the alternatives of a ``top_logprobs`` request."""


def tag(request: GenerationRequest, key: int, stream: bool) -> GenerationRequest:
    """``request`` with its live key (and stream flag) in a copy of its metadata."""
    meta = {**request.metadata, LIVE_TAG: key, STREAM_TAG: stream}
    return GenerationRequest(request.prompt_ids, request.params, request.group_id, meta)


def untag(metadata: dict[str, Any]) -> int | None:
    """Remove the live tags from ``metadata``; the key, or None for a request without one."""
    metadata.pop(STREAM_TAG, None)
    key = metadata.pop(LIVE_TAG, None)
    return None if key is None else int(key)


class WorkerStreams:
    """The worker's side (see module): which request id each key is, and what was sent."""

    def __init__(self, engine: SteppingEngine) -> None:
        self.engine = engine
        self.ids: dict[int, int] = {}  # key -> the engine's request id
        self.sent: dict[int, list[int]] = {}  # request id -> [key, tokens sent]

    def submitted(self, request: GenerationRequest, rid: int) -> Update | None:
        """Note an accepted request; its acceptance update when it is streamed."""
        key = request.metadata.get(LIVE_TAG)
        if key is None:
            return None
        self.ids[int(key)] = rid
        if not request.metadata.get(STREAM_TAG):
            return None
        self.sent[rid] = [int(key), 0]
        return int(key), [], [], []

    def abort(self, keys: Iterable[int]) -> None:
        """``engine.abort`` for the requests of ``keys`` still in the engine."""
        for key in keys:
            rid = self.ids.get(int(key))
            if rid is not None:
                self.engine.abort(rid)

    def finished(self, samples: Iterable[Sample]) -> None:
        """Forget the requests whose samples leave now."""
        for s in samples:
            key = s.metadata.get(LIVE_TAG)
            if key is not None:
                self.ids.pop(int(key), None)
                self.sent.pop(s.request_id, None)

    def updates(self) -> list[Update]:
        """Each streamed request's tokens gained since its last update (none: left out)."""
        out: list[Update] = []
        for rid, entry in self.sent.items():
            new = self.engine.progress(rid, entry[1])
            if new is not None and new[0]:
                entry[1] += len(new[0])
                out.append((entry[0], *(list(x) for x in new)))
        return out


class ClientStreams:
    """The client's side (see module): the tokens received per streamed key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[int, tuple[list[Any], ...]] = {}
        self.keys: set[int] = set()  # live keys whose sample has not arrived

    def submitted(self, key: int) -> None:
        with self._lock:
            self.keys.add(key)

    def add(self, updates: Iterable[Update]) -> None:
        """The worker's updates (receiver thread)."""
        with self._lock:
            for key, *new in updates:
                if key not in self.keys:  # its sample already arrived
                    continue
                got = self._tokens.setdefault(key, ([], [], []))
                if len(new) > len(got):  # the first alternatives (none before: none sent)
                    got = self._tokens[key] = (*got, [])
                for have, more in zip(got, new, strict=False):
                    have.extend(more)

    def forget(self, key: int) -> None:
        """The request's sample (or rejection) arrived: nothing more is kept for it."""
        with self._lock:
            self.keys.discard(key)
            self._tokens.pop(key, None)

    def progress(self, key: int, start: int = 0) -> Progress | None:
        """The streamed request's tokens from index ``start`` on (and their alternatives when it
        asked for ``top_logprobs``); None before the worker accepted it and after its sample
        arrived."""
        with self._lock:
            got = self._tokens.get(key)
            if got is None:
                return None
            return tuple(x[start:] for x in got)

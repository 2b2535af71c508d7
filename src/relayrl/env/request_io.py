"""A request's body and errors, and its CPU-heavy parts kept off the server's event loop.

The OpenAI-compatible endpoint (:mod:`relayrl.env.openai_server`) serves every request on one
asyncio loop. Reading a body, parsing its JSON and tokenising its prompt are done here instead:
the body is read up to a size limit (413 beyond it, told by ``Content-Length`` before a byte is
read, else while streaming), parsed and tokenised on a small pool of threads. A body that
names another model than the one served is answered 404 ``model_not_found`` (as OpenAI and vLLM
do) when the server is strict about it (``relayrl serve``). Each thread has
its own copy of the chat rendering (a Hugging Face fast tokenizer mutates its own padding and
truncation state on each call, so one instance is not shared between threads). One large
request then occupies one thread for a while; the loop keeps answering, and the other threads
keep tokenising the other requests.

A client that goes away before an unstreamed reply is ready (its timeout, a cancelled task) has
the reply cancelled (:func:`unless_disconnected`): the handler's generations are then aborted on
the engine, as a closed stream's are, instead of running to ``max_tokens`` for nobody.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from relayrl.env.openai_api import APIError

__all__ = ["DEFAULT_MAX_BODY", "ClientGone", "OffLoop", "read_body", "unless_disconnected"]

T = TypeVar("T")

DEFAULT_MAX_BODY = 16 << 20
"""Largest request body accepted (bytes); a larger one is answered 413."""


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes "
        "(relayrl serve --max-body-mb)",
        "request_too_large",
    )


class ClientGone(APIError):
    """The client disconnected before its reply was ready (answered to nobody)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", "client_closed")


async def unless_disconnected(request: Any, reply: Awaitable[T]) -> T:
    """Await ``reply`` (after the body was read); a client disconnect first cancels it and
    raises :class:`ClientGone`."""
    task = asyncio.ensure_future(reply)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientGone()
    return task.result()


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, refused (413) past ``limit`` bytes: by its
    ``Content-Length`` before reading, else as the chunks arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class OffLoop:
    """A pool of ``workers`` threads, each with its own deep copy of ``rendering``: ``run``
    awaits ``fn(rendering_copy, *args)`` on one of them, ``json_body`` reads and parses."""

    def __init__(self, rendering: Any, workers: int = 2) -> None:
        self._rendering = rendering
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="request-io")

    def _own(self) -> Any:
        mine = getattr(self._local, "rendering", None)
        if mine is None:
            with self._lock:  # one deep copy at a time
                mine = self._local.rendering = copy.deepcopy(self._rendering)
        return mine

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._own(), *args))

    async def json_body(self, request: Any, limit: int, model: str | None) -> dict[str, Any]:
        """The request's JSON object (read under ``limit``, parsed off the loop); with
        ``model``, one that names another model is a 404 ``model_not_found``."""
        raw = await read_body(request, limit)
        loop = asyncio.get_running_loop()
        try:
            body = await loop.run_in_executor(self._pool, json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(
                400, f"the request body is not valid JSON ({e})", "invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", "invalid_json")
        if model is not None and body.get("model") not in (None, model):
            raise APIError(
                404,
                f"the model {body['model']!r} does not exist (this server serves {model!r})",
                "model_not_found",
                "model",
            )
        return body

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

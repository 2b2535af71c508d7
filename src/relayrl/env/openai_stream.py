"""Token-by-token streaming for the endpoint (``stream: true``, :mod:`relayrl.env.openai_server`).

Each choice of a streamed request is generated with a token sink on the engine owner
(:meth:`relayrl.env.agent_engine.EngineOwner.generate`): after every engine step the tokens
the request gained cross to the server's event loop (``call_soon_threadsafe`` into an
``asyncio.Queue``) and go out at once as server-sent events: ``chat.completion.chunk`` /
``text_completion`` chunks, each with the text the tokens add, relayrl's ``token_ids`` and
``versions`` (and ``logprobs`` when asked, each token's ``top_logprobs`` alternatives with them
when the request asked for some: the engine hands them with the tokens), then per choice the
rest of its text (and its ``tool_calls``) and a finish chunk, (``stream_options.include_usage``)
a usage chunk, and ``data: [DONE]``. The first chunk leaves while the engine still generates
the request; token events of a choice that wait behind each other (a client slower than the
engine) are merged into one chunk.

Text. :class:`IncrementalDecoder` turns the growing id list into text deltas that join to
``decode(ids)``: with ``p <= r`` two offsets into the ids, ``prev = D(ids[p:r])`` and
``now = D(ids[p:])``, the delta is ``now[len(prev):]`` once ``now`` is longer and does not end
in U+FFFD (a multi-byte character or a BPE piece that only becomes valid text with the next
token is held until then); then ``p, r = r, len(ids)``. Decoding from ``p`` (one step behind)
keeps a tokenizer's boundary rules (a SentencePiece leading space) in both terms, so each step
decodes a few tokens, not the whole reply. :class:`ChoiceText` then holds back what may still
change: the tail that could begin a stop string (a stop string ends the choice: the text
before it is its text, the engine request is aborted, and no token after the one completing
it is sent, as the unstreamed reply cuts it), and, when tool calls are parsed under a chat
template, everything from a ``<tool_call>`` tag on and trailing whitespace (the reply's
content is then the text outside the blocks, stripped). At the finish the choice's final text
is the unstreamed reply's (the same function builds both), and the chunks carry what of it
was not yet sent: joined, the streamed text is the reply's text.

Disconnect. When the client goes away the event generator is closed (starlette cancels the
stream; :class:`EventStream` closes the generator in any case) and every unfinished choice is
aborted on the engine (``EngineOwner.abort``): its slot is free at the next step. A call is
recorded on its session only when the whole stream was generated.

The Responses API (``/v1/responses`` with ``stream: true``) streams the same chunks as its own
events (:func:`response_events`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any

from starlette.responses import StreamingResponse

from relayrl.env.agent_engine import EngineClosed, EngineOwner
from relayrl.env.openai_api import (
    APIError,
    chat_logprobs,
    chat_to_response,
    completion_top,
)
from relayrl.env.tools import OPEN_TAG
from relayrl.rollout.types import GenerationRequest, Sample

Decode = Callable[[Sequence[int]], str]
Event = tuple[int, Any, Any, Any, Any]
"""(choice, ids, logprobs, versions, alternatives or None), or (choice, future, None, ...)."""


class IncrementalDecoder:
    """Text deltas of a growing token list (see module): joined, ``decode(ids)``."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token: int) -> str:
        """Add one token; the text it makes valid (maybe "")."""
        self.ids.append(token)
        prev = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) <= len(prev) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(prev) :]

    def flush(self) -> str:
        """The text still held (an incomplete character at the end: as ``decode`` shows it)."""
        prev = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(prev) :] if len(now) > len(prev) else ""


def held_suffix(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a pattern."""
    best = 0
    for p in patterns:
        for n in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:n]):
                best = n
                break
    return best


class ChoiceText:
    """One choice's streamed text: decoded, cut at a stop string, held where it may change.

    ``text`` is everything decoded so far, ``sent`` the part already released (always a
    beginning of ``text``); ``stop_at`` is where a stop string begins once one appeared.
    """

    def __init__(self, decode: Decode, stops: Sequence[str], hold_tags: bool) -> None:
        self.decoder = IncrementalDecoder(decode)
        self.stops = list(stops)
        self.hold_tags = hold_tags
        self.patterns = self.stops + ([OPEN_TAG] if hold_tags else [])
        self.text = self.sent = ""
        self.stop_at: int | None = None

    def push(self, token: int) -> None:
        """Add one token (after a stop string nothing more is taken)."""
        before = len(self.text)
        self.text += self.decoder.push(token)
        for s in self.stops:  # the first stop (in the request's order) the text now holds
            j = self.text.find(s, max(0, before - len(s) + 1))
            if j >= 0:
                self.stop_at = j
                return

    def release(self) -> str:
        """The text that can no longer change (see class), not sent before; marks it sent."""
        if self.stop_at is not None:
            end = self.stop_at
        else:
            end = len(self.text) - held_suffix(self.text, self.patterns)
        if self.hold_tags:
            tag = self.text.find(OPEN_TAG)
            end = min(end, tag) if tag >= 0 else end
            end = len(self.text[:end].rstrip())
        delta = self.text[len(self.sent) : max(end, len(self.sent))]
        self.sent += delta
        return delta

    def rest(self, final: str | None) -> str:
        """What of the reply's final text was not sent (nothing when it does not extend the
        sent text: only whitespace next to a tool call under a template can do that)."""
        final = final or ""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


def failure(item: Any) -> BaseException | None:
    """The error of a finished generation future (a cancelled one's too); None otherwise."""
    if not isinstance(item, Future):
        return None
    return CancelledError() if item.cancelled() else item.exception()


def engine_error(exc: BaseException) -> APIError:
    """A failed generation as the endpoint's error (503: the engine is gone; 400: rejected)."""
    if isinstance(exc, EngineClosed):
        return APIError(503, str(exc), "engine_unavailable", kind="server_error")
    if isinstance(exc, ValueError):  # the engine rejected the request (InvalidRequestError)
        return APIError(400, str(exc), "invalid_request")
    if isinstance(exc, CancelledError):
        return APIError(500, "generation cancelled", "aborted", kind="server_error")
    return APIError(500, f"generation failed: {exc}", "aborted", kind="server_error")


class TokenStream:
    """The chunks of one streamed request, produced as the engine generates (see module).

    Args:
        owner: the engine owner.
        requests: one generation request per choice.
        kind: ``"chat"`` or ``"completion"``.
        head: the chunks' ``id``, ``created`` and ``model``.
        decode: ids -> the reply's text (before stop strings and tool calls).
        stops: each choice's stop strings.
        hold_tags: tool calls are parsed and taken out of the content (a chat template).
        token_text: id -> its text, for per-token ``logprobs`` (None: no logprobs).
        finish: ``(choice index, sample) -> the unstreamed reply's choice`` (``message`` /
            ``text`` and ``finish_reason``), called as each choice finishes.
        close: ``() -> usage``, called once every choice finished (records the calls).
        include_usage: end with a usage chunk.
    """

    def __init__(
        self,
        owner: EngineOwner,
        requests: Sequence[GenerationRequest],
        kind: str,
        head: dict[str, Any],
        decode: Decode,
        stops: Sequence[Sequence[str]],
        hold_tags: bool,
        token_text: Callable[[int], str] | None,
        finish: Callable[[int, Sample], dict[str, Any]],
        close: Callable[[], dict[str, Any]],
        include_usage: bool,
    ) -> None:
        self.owner, self.requests, self.kind = owner, list(requests), kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.head = {**head, "object": obj}
        self.texts = [ChoiceText(decode, s, hold_tags) for s in stops]
        self.token_text, self.finish, self.close = token_text, finish, close
        self.include_usage = include_usage
        self.futures: list[Future[Sample]] = []
        self.offsets = [0] * len(self.requests)  # completions' logprobs text_offset
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._early: list[Event] = []

    # ------------------------------------------------------------------ engine side
    async def start(self) -> None:
        """Submit every choice and wait until the engine accepted each (its first event): a
        rejected request is an :class:`APIError` before any byte of the stream is sent."""
        loop = asyncio.get_running_loop()
        try:
            for i, req in enumerate(self.requests):
                fut = self.owner.generate(req, on_tokens=partial(self._put, loop, i))
                fut.add_done_callback(partial(self._done, loop, i))
                self.futures.append(fut)
        except EngineClosed as closed:
            self.abort()
            raise engine_error(closed) from None
        waiting = set(range(len(self.requests)))
        try:
            while waiting:
                item = await self._queue.get()
                self._early.append(item)
                waiting.discard(item[0])
                failed = failure(item[1])
                if failed is not None:
                    raise engine_error(failed)
        except BaseException:
            self.abort()
            raise

    def _put(self, loop: asyncio.AbstractEventLoop, i: int, *tokens: Any) -> None:
        pad = (None,) * (4 - len(tokens))  # no alternatives / a finished future's event
        item: Event = (i, *tokens, *pad)  # type: ignore[assignment]
        try:  # on the owner thread
            loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the server's loop is closed: nobody listens any more
            pass

    def _done(self, loop: asyncio.AbstractEventLoop, i: int, fut: Future[Sample]) -> None:
        self._put(loop, i, fut, None, None)

    def abort(self) -> None:
        """Stop every choice still generating (a disconnect, an error)."""
        for fut in self.futures:
            if not fut.done():
                self.owner.abort(fut)

    # ------------------------------------------------------------------ chunks
    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks (see module); unfinished choices are aborted when it ends."""
        try:
            if self.kind == "chat":
                for i in range(len(self.requests)):
                    delta = {"role": "assistant", "content": ""}
                    yield self._chunk(i, {"delta": delta, "logprobs": None})
            left = len(self.requests)
            while left:
                i, a, b, c, d = self._early.pop(0) if self._early else await self._next()
                if not isinstance(a, Future):
                    chunk = self._tokens(i, a, b, c, d)
                    if chunk is not None:
                        yield chunk
                    continue
                left -= 1
                exc = failure(a)
                if exc is not None:
                    yield engine_error(exc).body()
                    return
                for chunk in self._final(i, a.result()):
                    yield chunk
            usage = self.close()
            if self.include_usage:
                yield {**self.head, "choices": [], "usage": usage}
        finally:
            self.abort()

    async def _next(self) -> Event:
        """The next event; the token events of one choice already waiting behind it are
        merged into it (a client or loop slower than the engine gets fewer, larger chunks)."""
        i, a, b, c, d = await self._queue.get()
        while not isinstance(a, Future) and not self._queue.empty():
            j, a2, b2, c2, d2 = self._queue.get_nowait()
            if j != i or isinstance(a2, Future):
                self._early.append((j, a2, b2, c2, d2))
                break
            a, b, c = a + a2, b + b2, c + c2
            d = None if d is None and d2 is None else (d or []) + (d2 or [])
        return i, a, b, c, d

    def _chunk(self, i: int, fields: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": i, **fields}
        choice.setdefault("finish_reason", None)
        return {**self.head, "choices": [choice]}

    def _tokens(
        self, i: int, ids: list[int], lps: list[float], vs: list[int], tops: Any
    ) -> dict[str, Any] | None:
        st = self.texts[i]
        n = 0
        for t in ids:
            if st.stop_at is not None:
                break
            st.push(t)
            n += 1
        if st.stop_at is not None and n:
            self.owner.abort(self.futures[i])  # its text is complete: free the slot
        delta = st.release()
        if not n and not delta:
            return None
        fields: dict[str, Any] = {"token_ids": ids[:n], "versions": vs[:n]}
        fields["logprobs"] = self._logprobs(i, ids[:n], lps[:n], tops and tops[:n])
        if self.kind == "chat":
            fields["delta"] = {"content": delta}
        else:
            fields["text"] = delta
        return self._chunk(i, fields)

    def _logprobs(self, i: int, ids: list[int], lps: list[float], tops: Any) -> Any:
        """A chunk's ``logprobs`` (``tops``: each token's alternatives as (id, logprob))."""
        text = self.token_text
        if text is None:
            return None
        toks = [text(t) for t in ids]
        alts = None if tops is None else [[(text(t), v) for t, v in top] for top in tops]
        if self.kind == "chat":
            return chat_logprobs(toks, lps, alts)
        offsets = []
        for t in toks:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(t)
        top = completion_top(alts)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    def _final(self, i: int, sample: Sample) -> list[dict[str, Any]]:
        """A finished choice: the rest of its text (and its tool calls), then its finish."""
        choice = self.finish(i, sample)
        st = self.texts[i]
        out = []
        if self.kind == "chat":
            msg = choice["message"]
            rest = st.rest(msg.get("content"))
            if msg.get("tool_calls"):
                calls = [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]
                delta = {"content": rest or None, "tool_calls": calls}
                out.append(self._chunk(i, {"delta": delta, "logprobs": None}))
            elif rest:
                out.append(self._chunk(i, {"delta": {"content": rest}, "logprobs": None}))
            end = {"delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            rest = st.rest(choice["text"])
            if rest:
                out.append(self._chunk(i, {"text": rest, "logprobs": None}))
            end = {"text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        out.append(self._chunk(i, end))
        return out


async def response_events(
    chunks: AsyncIterator[dict[str, Any]], reply: dict[str, Any], body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """A streamed ``/v1/responses`` call: the Responses API's events over the chat stream's
    chunks (one choice). ``response.created`` / ``in_progress``; the text as a ``message`` item
    (``output_item.added``, ``content_part.added``, an ``output_text.delta`` per chunk with
    text, then the ``.done`` events) opened at its first text; each function call as an item
    with its arguments in one delta; then ``response.completed`` (``response.incomplete`` at
    the token limit) holding the unstreamed reply's ``response`` (``reply``: the chat reply,
    filled when the choice finished; the message item keeps the streamed item's id)."""
    rid = "resp_" + str(reply["id"]).removeprefix("chatcmpl-")
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    seq = itertools.count()
    text: list[str] = []
    opened = False

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def opening() -> list[dict[str, Any]]:
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant"}
        part = {"type": "output_text", "text": "", "annotations": []}
        ref = {"item_id": msg_id, "output_index": 0, "content_index": 0}
        return [
            event("response.output_item.added", output_index=0, item={**item, "content": []}),
            event("response.content_part.added", **ref, part=part),
        ]

    start = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": reply["model"],
        "output": [],
    }
    try:
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for chunk in chunks:
            if "error" in chunk:
                yield chunk
                return
            for ch in chunk.get("choices") or []:
                delta = (ch.get("delta") or {}).get("content")
                if delta:
                    if not opened:
                        opened = True
                        for e in opening():
                            yield e
                    text.append(delta)
                    ref = {"item_id": msg_id, "output_index": 0, "content_index": 0}
                    yield event("response.output_text.delta", **ref, delta=delta, logprobs=[])
        final = chat_to_response(reply, body)
        items = final["output"]
        if items and items[0]["type"] == "message":
            items[0]["id"] = msg_id
            if not opened:  # no text was streamed before the finish
                for e in opening():
                    yield e
            part = items[0]["content"][0]
            ref = {"item_id": msg_id, "output_index": 0, "content_index": 0}
            yield event("response.output_text.done", **ref, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ref, part=part)
            yield event("response.output_item.done", output_index=0, item=items[0])
        for k, item in enumerate(items):
            if item["type"] != "function_call":
                continue
            ref = {"item_id": item["id"], "output_index": k}
            args = item["arguments"]
            added = {**item, "arguments": "", "status": "in_progress"}
            yield event("response.output_item.added", output_index=k, item=added)
            yield event("response.function_call_arguments.delta", **ref, delta=args)
            yield event("response.function_call_arguments.done", **ref, arguments=args)
            yield event("response.output_item.done", output_index=k, item=item)
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event(done, response=final)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def sse(events: AsyncIterator[dict[str, Any]], named: bool = False) -> AsyncIterator[bytes]:
    """Server-sent events: ``data: <json>`` per event, then ``data: [DONE]``; ``named`` (the
    Responses API): ``event: <type>`` before each, no ``[DONE]``."""
    try:
        async for e in events:
            head = f"event: {e.get('type', 'error')}\n" if named else ""
            yield f"{head}data: {json.dumps(e)}\n\n".encode()
        if not named:
            yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that closes its body generator however it ends (a
    client that went away included), so the generator's cleanup (aborts) always runs."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

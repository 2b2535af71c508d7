"""An OpenAI-compatible HTTP endpoint over a relayrl engine, recording token-exact sessions.

A real server (FastAPI app run by uvicorn in a background thread, bound to 127.0.0.1 on an
ephemeral port unless told otherwise) so that an agent written against the official
``openai`` client can run unchanged, for training (its calls are recorded per session and
become training samples: :mod:`relayrl.env.sessions`) or for evaluation (``relayrl serve``).

Routes (each also under ``/s/<session>/v1/...``):

- ``POST /v1/chat/completions``: messages -> the tokenizer's chat template (or the plain
  format; :mod:`relayrl.env.agent_chat`) -> prompt ids; ``tools`` reach the template; the
  reply's ``<tool_call>`` blocks become ``tool_calls``. Sampling: ``temperature`` (default
  1), ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop`` (strings), ``seed``,
  ``n`` (1 to :data:`MAX_N` choices of one prompt, generated concurrently; choice ``i`` is
  seeded ``seed + i``, or from the session seed; each is recorded as its own call, so the
  second and later ones branch: a trajectory each), ``logprobs`` (the sampled token's
  behaviour logprob), ``top_logprobs`` (0 to 20 alternatives per token, with ``logprobs``:
  under the distribution sampled from, :mod:`relayrl.rollout.top_logprobs`: every backend,
  the built-in engine, an engine process, vLLM; an engine without them refuses it with 400).
  ``stream: true`` answers server-sent events as the engine generates
  (:mod:`relayrl.env.openai_stream`).
- ``POST /v1/responses``: the Responses API over the chat route (:mod:`relayrl.env.openai_api`).
- Parameters the endpoint does not honour are refused with 400 naming them
  (``openai_api.refuse_unsupported``: ``tool_choice`` required / named, penalties, ...).
- ``POST /v1/completions``: ``prompt`` as text or as token ids (``list[int]``), or a batch of
  either (``list[str]`` / ``list[list[int]]``: choice ``i * n + j`` is prompt ``i``'s choice
  ``j``, as vLLM indexes them; each prompt's choices are seeded as a request of its own; the
  usage counts each prompt once; ``prompt_token_ids`` is then the list of the prompts' ids),
  same sampling; ``logprobs`` (an int k in 0-20) gives ``tokens`` / ``token_logprobs`` /
  ``text_offset`` and ``top_logprobs`` (k alternatives per token; null when k is 0 or the
  engine keeps none).
- ``POST /tokenize``, ``POST /detokenize``: vLLM's (:mod:`relayrl.env.openai_tokenize`).
- vLLM's extra sampling fields ``top_k``, ``stop_token_ids`` and ``ignore_eos`` are honoured
  by both (the ``openai`` client sends them with ``extra_body``).
- ``GET /v1/models``: the one served model, with its ``max_model_len`` as vLLM lists it
  (``GET /v1/models/<name>``: it alone, 404 for another name). ``GET /health``: 200 while
  the engine runs, 503 once it is gone.

Every choice also carries relayrl's fields ``token_ids`` (the completion's ids), ``versions``
(the policy version the engine stamped on each token) and the response ``prompt_token_ids``;
the ``openai`` client keeps them in ``model_extra``.

Sessions. The session key comes from the path (``base_url=http://127.0.0.1:PORT/s/<key>/v1``),
else the ``X-Session-Id`` header, else the API key (``Authorization: Bearer <key>``) when it
names an open session. A key in the path or header that names no open session is a 404
(``session_not_found``); with ``api_key`` set, any other bearer is a 401. Calls without a
session are served and not recorded. A session's ``sampling`` settings are enforced over
the request's (training: the rollout config's temperature / top_p / top_k, so the trainer
recomputes logprobs under the distribution that was sampled; ``max_tokens`` is a cap; each
call's seed derives from the session seed).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for
a malformed body or bad parameters (``stream_options`` without ``stream: true``; a
``max_tokens`` / ``max_completion_tokens`` larger than the context leaves after the prompt,
``max_tokens > context - prompt``, as vLLM: unless ``cap_max_tokens``, which the training
endpoint sets, cuts it to the rest), ``context_length_exceeded`` when the prompt leaves no room
to generate, ``too_many_sequences`` past ``max_sequences_per_request`` (prompts x ``n``,
counted before anything is tokenised or queued), 401 / 404 as above (``model_not_found`` with
``strict_model``), 413 past ``max_body_bytes``, 503 when the engine is gone. Bodies are parsed
and prompts tokenised off the event loop (:mod:`relayrl.env.request_io`): one large request
does not hold up the rest.

Engine access: through one :class:`~relayrl.env.agent_engine.EngineOwner` thread (the engine is
single-threaded); handlers only queue requests on it and await their futures, so versions and
logprobs are the engine's own.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from relayrl.env.agent_chat import BadMessages, ChatRendering, normalise_messages
from relayrl.env.agent_engine import EngineClosed, EngineOwner
from relayrl.env.openai_api import (
    APIError,
    chat_choice,
    chat_to_response,
    check_room,
    check_sequences,
    completion_choice,
    completion_prompts,
    logprobs_on,
    record_call,
    refuse_unsupported,
    responses_to_chat,
    sampling_params,
    top_asked,
)
from relayrl.env.openai_api import integer as _int
from relayrl.env.openai_stream import (
    EventStream,
    TokenStream,
    engine_error,
    response_events,
    sse,
)
from relayrl.env.openai_tokenize import detokenize, tokenize
from relayrl.env.request_io import DEFAULT_MAX_BODY, OffLoop, unless_disconnected
from relayrl.env.sessions import CallRecord, Session, SessionStore
from relayrl.rollout.types import GenerationRequest, Sample, SamplingParams

MAX_N = 16
"""Most choices one request may ask for (``n``)."""

DEFAULT_MAX_SEQUENCES = 256
"""Most sequences (prompts x ``n``) one request may ask for, unless the server is told."""

DEFAULT_MAX_TOKENS = 256
"""Completion tokens when the request gives no ``max_tokens`` (then capped by the context)."""


class OpenAIServer:
    """The endpoint (see module): ``start()`` -> base URL, ``open_session()``, ``stop()``.

    Args:
        engine: an :class:`EngineOwner`, or an engine to wrap in one (owned: closed on stop).
        tokenizer: the model's tokenizer (chat template, decoding).
        model_name: the name ``/v1/models`` lists (requests may name any model).
        host, port: where to listen (port 0: an ephemeral port, read back after start).
        api_key: when set, a bearer that is neither this key nor an open session is refused.
        default_max_tokens: completion budget of a request that names none (None: the rest of
            the context, as vLLM and OpenAI; ``DEFAULT_MAX_TOKENS`` when the engine has none).
        max_body_bytes: a larger request body is answered 413.
        max_sequences_per_request: a request asking for more sequences (prompts x ``n``) is
            answered 400 (None: unbounded, as vLLM).
        strict_model: a request that names another model is answered 404 (``relayrl serve``).
        cap_max_tokens: a ``max_tokens`` past the context is cut to the rest of it (training's
            agents: a long conversation ends in ``length``) instead of a 400 (vLLM's answer).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        model_name: str = "relayrl",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        max_body_bytes: int = DEFAULT_MAX_BODY,
        strict_model: bool = False,
        cap_max_tokens: bool = False,
        max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES,
    ) -> None:
        if max_sequences_per_request is not None and max_sequences_per_request < 1:
            raise ValueError("max_sequences_per_request must be >= 1 or None (unbounded)")
        self._own_owner = not isinstance(engine, EngineOwner)
        self.owner = EngineOwner(engine) if self._own_owner else engine
        self.tokenizer = tokenizer
        self.rendering = ChatRendering(tokenizer)
        self.model_name = model_name
        self.host, self.port = host, port
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes, self.strict_model = max_body_bytes, strict_model
        self.cap_max_tokens, self.max_sequences = cap_max_tokens, max_sequences_per_request
        self.off_loop = OffLoop(self.rendering)  # parsing and tokenising, off the event loop
        self.sessions = SessionStore()
        self.app = self._build_app()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        """``http://host:port`` (after ``start``)."""
        return f"http://{self.host}:{self.port}"

    def base_url(self, session: str | Session | None = None) -> str:
        """The ``base_url`` for an ``openai`` client: ``.../v1`` or ``.../s/<key>/v1``."""
        if session is None:
            return f"{self.url}/v1"
        key = session.key if isinstance(session, Session) else session
        return f"{self.url}/s/{key}/v1"

    def open_session(self, key: str | None = None, **kwargs: Any) -> Session:
        """A new recorded session (``sampling=``, ``metadata=``: see :class:`SessionStore`)."""
        return self.sessions.open(key, **kwargs)

    def close_session(self, key: str) -> Session | None:
        return self.sessions.close(key)

    def start(self, timeout: float = 30.0) -> str:
        """Serve in a background thread; returns the base URL once it accepts connections."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("the server is already started")
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="openai-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.base_url()

    def _serve(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn exits on a bind error; start() reports it
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (in-flight requests get up to ``timeout`` s), then an owned owner."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = self._server = None
        if self._own_owner:
            self.owner.close()

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the app
    def _build_app(self) -> Any:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="relayrl OpenAI-compatible endpoint", docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(HTTPException)
        async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
            err = APIError(
                exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None
            )
            return JSONResponse(err.body(), status_code=exc.status_code)

        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/tokenize", self._tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self._detokenize, methods=["POST"])
        for prefix in ("/v1", "/s/{session_key}/v1"):
            app.add_api_route(prefix + "/models", self._models, methods=["GET"])
            app.add_api_route(prefix + "/models/{model_id:path}", self._model, methods=["GET"])
            app.add_api_route(prefix + "/chat/completions", self._chat, methods=["POST"])
            app.add_api_route(prefix + "/completions", self._completions, methods=["POST"])
            app.add_api_route(prefix + "/responses", self._responses, methods=["POST"])
        return app

    async def _health(self) -> dict[str, Any]:
        if self.owner.closed:
            raise APIError(503, "the engine is gone", "engine_unavailable", kind="server_error")
        return {}

    async def _tokenize(self, request: Request) -> Any:
        self._session(request, None)  # the API key
        body = await self._plain_body(request)
        return await tokenize(self.off_loop, body, self.owner.max_model_len)

    async def _detokenize(self, request: Request) -> Any:
        self._session(request, None)
        body = await self._plain_body(request)
        return await detokenize(self.off_loop, body, len(self.tokenizer))

    async def _plain_body(self, request: Request) -> dict[str, Any]:
        model = self.model_name if self.strict_model else None
        return await self.off_loop.json_body(request, self.max_body_bytes, model)

    async def _models(self, request: Request, session_key: str | None = None) -> dict[str, Any]:
        self._session(request, session_key)
        return {"object": "list", "data": [self._card()]}

    async def _model(
        self, request: Request, model_id: str, session_key: str | None = None
    ) -> dict[str, Any]:
        self._session(request, session_key)
        if model_id != self.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", "model_not_found")
        return self._card()

    def _card(self) -> dict[str, Any]:
        """The model card (vLLM's fields ``root`` and ``max_model_len`` too: the context)."""
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relayrl"}
        return {**card, "root": self.model_name, "max_model_len": self.owner.max_model_len}

    def _session(self, request: Request, path_key: str | None) -> Session | None:
        """The request's session (see module), or None for an unrecorded call."""
        key = path_key or request.headers.get("x-session-id")
        if key:
            session = self.sessions.get(key)
            if session is None:
                raise APIError(
                    404, f"session {key!r} is not open on this server", "session_not_found"
                )
            return session
        auth = request.headers.get("authorization", "")
        bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        session = self.sessions.get(bearer) if bearer else None
        if session is None and self.api_key is not None and bearer != self.api_key:
            raise APIError(401, "invalid API key", "invalid_api_key", kind="authentication_error")
        return session

    async def _body(self, request: Request, chat: bool = True) -> dict[str, Any]:
        body = await self._plain_body(request)
        refuse_unsupported(body)
        logprobs_on(body, chat)  # a bad type: 400 before generating
        if body.get("stream") not in (None, True, False):
            raise APIError(400, "stream must be a boolean", "invalid_type", "stream")
        if body.get("stream_options") is not None and not body.get("stream"):
            raise APIError(
                400,
                "stream_options is only allowed with stream: true",
                "invalid_value",
                "stream_options",
            )
        n = _int(body, "n")
        if n is not None and not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", "invalid_value", "n")
        check_sequences(body, chat, self.max_sequences)
        return body

    # ------------------------------------------------------------------ sampling
    def _params(
        self, body: dict[str, Any], session: Session | None
    ) -> tuple[SamplingParams, list[str]]:
        """Sampling params of a request (a session's settings win) and its stop strings."""
        default = self.default_max_tokens or self.owner.max_model_len or DEFAULT_MAX_TOKENS
        return sampling_params(body, session, self.rendering, default)

    def _check_context(self, prompt: Sequence[int], kind: str, body: dict[str, Any]) -> None:
        """Room to generate, and (unless ``cap_max_tokens``) for the asked ``max_tokens``."""
        check_room(len(prompt), self.owner.max_model_len, {} if self.cap_max_tokens else body, kind)

    async def _generate(
        self, prompt: list[int], params: SamplingParams, session: Session | None
    ) -> Sample:
        meta = {"session": session.key} if session is not None else {}
        try:
            fut = self.owner.generate(GenerationRequest(prompt, params, metadata=meta))
            sample = await asyncio.wrap_future(fut)
        except (EngineClosed, ValueError) as e:  # gone (503), or rejected the request (400)
            raise engine_error(e) from None
        except asyncio.CancelledError:  # the client went away: free the engine's slot
            self.owner.abort(fut)
            raise
        if sample.error is not None or sample.finish_reason == "abort":
            raise APIError(
                500,
                f"generation aborted: {sample.error or 'aborted'}",
                "aborted",
                kind="server_error",
            )
        return sample

    async def _run(
        self, kind: str, prompts: list[list[int]], body: dict[str, Any], session: Session | None
    ) -> list[tuple[CallRecord, str | None]]:
        """Generate the ``n`` choices of each prompt (all concurrently), cut each at a stop
        string, record them on the session in choice order (prompt-major): each choice's call
        and its stop."""
        for prompt in prompts:
            self._check_context(prompt, kind, body)
        runs = [(p, *r) for p in prompts for r in self._choice_params(kind, body, session)]
        samples = await asyncio.gather(*(self._generate(p, q, session) for p, q, _ in runs))
        out = [self._call(kind, *run, sample) for sample, run in zip(samples, runs, strict=True)]
        for call, _ in out:
            if session is not None:
                session.record(call)
        return out

    def _choice_params(
        self, kind: str, body: dict[str, Any], session: Session | None
    ) -> list[tuple[SamplingParams, list[str]]]:
        """Each of the ``n`` choices' sampling params and stop strings (choice ``i``: seed + i)."""
        seed = _int(body, "seed")
        alternatives = bool(getattr(self.owner.engine, "supports_top_logprobs", False))
        top = top_asked(body, kind == "chat", alternatives)
        runs = [
            self._params(body if seed is None or i == 0 else {**body, "seed": seed + i}, session)
            for i in range(_int(body, "n") or 1)
        ]
        for params, _ in runs:
            params.top_logprobs = top
        return runs

    def _call(
        self, kind: str, prompt: list[int], params: SamplingParams, stops: list[str], sample: Sample
    ) -> tuple[CallRecord, str | None]:
        return record_call(self.tokenizer, kind, prompt, params, stops, sample)

    @staticmethod
    def _usage(prompts: Sequence[list[int]], calls: Sequence[CallRecord]) -> dict[str, int]:
        """Each prompt once, every choice's completion tokens."""
        p, c = sum(map(len, prompts)), sum(len(x.completion_ids) for x in calls)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _token_text(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def _chat_choice(
        self, index: int, call: CallRecord, hit: str | None, parse: bool, lps: bool
    ) -> dict[str, Any]:
        texts = self._token_text(call.completion_ids) if lps else None
        return chat_choice(self.rendering, index, call, hit, parse, texts, self._alts(call))

    def _completion_choice(
        self, index: int, call: CallRecord, hit: str | None, lps: bool
    ) -> dict[str, Any]:
        texts = self._token_text(call.completion_ids) if lps else None
        return completion_choice(self.tokenizer, index, call, hit, texts, self._alts(call))

    def _alts(self, call: CallRecord) -> list[list[tuple[str, float]]] | None:
        """Each token's alternatives as (text, logprob), when the call asked for them."""
        tops = call.top_logprobs
        return (
            None if tops is None else [[(self._token_text([t])[0], v) for t, v in x] for x in tops]
        )

    # ------------------------------------------------------------------ routes
    async def _chat(self, request: Request, session_key: str | None = None) -> Any:
        return await self._route("chat", request, session_key)

    async def _completions(self, request: Request, session_key: str | None = None) -> Any:
        return await self._route("completion", request, session_key)

    async def _route(self, kind: str, request: Request, session_key: str | None) -> Any:
        session = self._session(request, session_key)
        body = await self._counted(session, self._body(request, kind == "chat"))
        if body.get("stream"):
            return await self._counted(session, self._stream(kind, body, session))
        reply = self._chat_reply if kind == "chat" else self._completion_reply
        return await self._counted(session, unless_disconnected(request, reply(body, session)))

    async def _responses(self, request: Request, session_key: str | None = None) -> Any:
        session = self._session(request, session_key)
        raw = await self._counted(session, self._body(request))

        async def reply() -> Any:
            chat = responses_to_chat(raw)
            refuse_unsupported(chat)
            if raw.get("stream"):  # response events over the chat stream
                stream, final = await self._token_stream("chat", chat, session)
                return EventStream(sse(response_events(stream.events(), final, raw), named=True))
            reply = await unless_disconnected(request, self._chat_reply(chat, session))
            return chat_to_response(reply, raw)

        return await self._counted(session, reply())

    async def _stream(self, kind: str, body: dict[str, Any], session: Session | None) -> Any:
        stream, _ = await self._token_stream(kind, body, session)
        return EventStream(sse(stream.events()))

    async def _token_stream(
        self, kind: str, body: dict[str, Any], session: Session | None
    ) -> tuple[TokenStream, dict[str, Any]]:
        """``stream: true``: chunks as the engine generates (:mod:`relayrl.env.openai_stream`),
        started; and the unstreamed reply, filled once every choice finished (its calls are
        then recorded, as the unstreamed reply's)."""
        chat = kind == "chat"
        prompts, parse = await (self._chat_prompt(body) if chat else self._completion_prompts(body))
        for prompt in prompts:
            self._check_context(prompt, kind, body)
        runs = [(p, *r) for p in prompts for r in self._choice_params(kind, body, session)]
        meta = {"session": session.key} if session is not None else {}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        calls: dict[int, tuple[CallRecord, dict[str, Any]]] = {}
        model = body.get("model") or self.model_name
        reply: dict[str, Any] = {"id": rid, "model": model}
        reply["prompt_token_ids"] = prompts[0] if len(prompts) == 1 else prompts

        def finish(i: int, sample: Sample) -> dict[str, Any]:
            call, hit = self._call(kind, *runs[i], sample)
            call.response_id = rid
            if chat:
                calls[i] = call, self._chat_choice(i, call, hit, parse, False)
            else:
                calls[i] = call, self._completion_choice(i, call, hit, False)
            return calls[i][1]

        def close() -> dict[str, Any]:
            done = [calls[i][0] for i in range(len(runs))]
            for call in done:
                if session is not None:
                    session.record(call)
            reply["choices"] = [calls[i][1] for i in range(len(runs))]
            reply["usage"] = self._usage(prompts, done)
            return reply["usage"]

        def decode(ids: Sequence[int]) -> str:
            if chat:
                return str(self.rendering.message(ids, parse_tools=False)["content"])
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))

        logprobs = logprobs_on(body, chat)
        stream = TokenStream(
            self.owner,
            [GenerationRequest(p, q, metadata=dict(meta)) for p, q, _ in runs],
            kind,
            {"id": rid, "created": int(time.time()), "model": model},
            decode,
            [stops for _, _, stops in runs],
            parse and self.rendering.template,
            (lambda t: self._token_text([t])[0]) if logprobs else None,
            finish,
            close,
            bool((body.get("stream_options") or {}).get("include_usage")),
        )
        await stream.start()
        return stream, reply

    @staticmethod
    async def _counted(session: Session | None, reply: Any) -> Any:
        """Await a reply; an error answered to a session is counted on it."""
        try:
            return await reply
        except APIError:
            if session is not None:
                session.count_error()
            raise

    def _reply(
        self,
        kind: str,
        body: dict[str, Any],
        prompts: list[list[int]],
        calls: list[tuple[CallRecord, str | None]],
        rid: str,
    ) -> dict[str, Any]:
        for c, _ in calls:
            c.response_id = rid
        return {
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.model_name),
            "usage": self._usage(prompts, [c for c, _ in calls]),
            "prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts,
        }

    async def _chat_prompt(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """The prompt ids of a chat request (a list of one), and whether tool calls are parsed."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "tools must be a list of tool definitions", "invalid_type", "tools")
        try:
            messages = normalise_messages(body.get("messages"))
            prompt = await self.off_loop.run(ChatRendering.prompt_ids, messages, tools)
        except BadMessages as e:
            raise APIError(400, str(e), "invalid_messages", "messages") from None
        return [prompt], bool(tools) and body.get("tool_choice") != "none"

    async def _chat_reply(self, body: dict[str, Any], session: Session | None) -> dict[str, Any]:
        prompts, parse = await self._chat_prompt(body)
        calls = await self._run("chat", prompts, body, session)
        reply = self._reply("chat", body, prompts, calls, f"chatcmpl-{uuid.uuid4().hex[:24]}")
        reply["choices"] = [
            self._chat_choice(i, call, hit, parse, logprobs_on(body, True))
            for i, (call, hit) in enumerate(calls)
        ]
        return reply

    async def _completion_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        """The prompts' ids of a completions request (text or ids, one or a batch)."""
        return [
            p if isinstance(p, list) else await self.off_loop.run(ChatRendering.encode, p)
            for p in completion_prompts(body)
        ], False

    async def _completion_reply(
        self, body: dict[str, Any], session: Session | None
    ) -> dict[str, Any]:
        """Choice ``i * n + j``: prompt ``i``'s choice ``j`` (as vLLM indexes a batch)."""
        prompts, _ = await self._completion_prompts(body)
        calls = await self._run("completion", prompts, body, session)
        on = logprobs_on(body, False)
        reply = self._reply("completion", body, prompts, calls, f"cmpl-{uuid.uuid4().hex[:24]}")
        reply["choices"] = [
            self._completion_choice(i, call, hit, on) for i, (call, hit) in enumerate(calls)
        ]
        return reply

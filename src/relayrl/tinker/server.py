"""The Tinker HTTP API (``/api/v1/...``) over a :class:`~relayrl.tinker.service.TinkerService`.

Bound to 127.0.0.1 (port 0: an ephemeral one). The SDK sends its API key in ``X-API-Key``;
any key starting ``tml-`` is accepted unless the service was given one (``api_key``).

Protocol, as the SDK (``tinker`` 0.38) speaks it:

- ``POST /api/v1/client/config`` (feature flags: no JWT exchange, plain httpx transport,
  per-request ``retrieve_future`` polling, custom losses client-side), ``client/dynamic_config``,
  ``create_session``, ``session_heartbeat``, ``telemetry`` (accepted, dropped), ``healthz``,
  ``GET get_server_capabilities``; ``sessions/{id}/finish`` ends a session (``ServiceClient.
  close``), and a heartbeat for an ended session answers 410, on which the SDK stops its
  heartbeat loop.
- Work requests answer an ``UntypedAPIFuture`` (``request_id``): ``create_model``,
  ``forward_backward`` (a protobuf body, optionally zstd), ``optim_step``, ``save_weights``,
  ``load_weights``, ``save_weights_for_sampler``, ``asample``, ``unload_model``.
- ``POST /api/v1/retrieve_future`` long-polls (up to :data:`POLL_S`) and answers the result:
  protobuf for ``ForwardBackwardOutput`` / ``SampleResponse``, JSON otherwise;
  ``{"type": "try_again", ...}`` while queued or running; ``{"error", "category"}`` for a
  failed request (the SDK raises ``tinker.RequestFailedError``; category ``user`` for the
  caller's mistakes).
- Direct answers: ``get_info``, ``create_sampling_session``, ``join_sampling_session``,
  ``GET samplers/{id}``, ``GET training_runs/{model_id}``, ``GET training_runs/{model_id}/
  checkpoints``, and the ``RestClient`` routes of :mod:`relayrl.tinker.rest` (runs,
  checkpoints, sessions).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from relayrl.tinker.rest import error, register_rest_routes, training_run
from relayrl.tinker.sampling import SampleJob
from relayrl.tinker.service import TinkerService, UserError
from relayrl.tinker.topk import check_k
from relayrl.tinker.wire import PROTO_CONTENT_TYPE, WireError, decode_forward_backward
from relayrl.tinker.worker import Result, Worker

POLL_S = 20.0
"""How long one retrieve_future waits for a result before answering try_again."""

log = logging.getLogger(__name__)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


class TinkerServer:
    """``relayrl tinker-serve``: the service's HTTP front in a background thread."""

    def __init__(
        self,
        service: TinkerService,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        client_config: dict[str, Any] | None = None,
    ) -> None:
        """``client_config``: overrides of the feature flags the SDK is sent
        (:data:`CLIENT_CONFIG`), e.g. ``{"proto_compress_fwdbwd": True}``."""
        if api_key is not None and not api_key.startswith("tml-"):
            raise ValueError("the Tinker SDK only sends API keys that start with 'tml-'")
        self.service = service
        self.host, self.port = host, port
        self.api_key = api_key
        self.client_config = {**CLIENT_CONFIG, **(client_config or {})}
        self.worker = Worker(service.sample)
        self._finished: set[str] = set()
        self.sessions: dict[str, dict[str, Any]] = {}  # every session, oldest first: its metadata
        self.session_samplers: dict[str, list[str]] = {}
        self.app = self._build_app()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> str:
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="tinker-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tinker-serve did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])
        return self.base_url()

    def _serve(self) -> None:
        try:
            self._server.run()
        except SystemExit:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = self._server = None
        self.worker.close()

    def __enter__(self) -> TinkerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the app
    def _build_app(self) -> Any:  # noqa: C901 - one flat list of routes

        app = FastAPI()
        svc, worker = self.service, self.worker

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            key = request.headers.get("x-api-key") or ""
            if self.api_key is not None and key != self.api_key:
                return error(401, "invalid API key")
            if self.api_key is None and not key.startswith("tml-"):
                return error(401, "an API key starting with 'tml-' is required")
            try:
                return await call_next(request)
            except UserError as e:  # a direct answer's user error
                return error(404 if "unknown" in str(e) else 400, str(e))
            except (KeyError, TypeError, ValueError) as e:  # a malformed body: no retry
                return error(400, f"malformed request: {type(e).__name__}: {e}")

        def future(
            fn: Any = None,
            sample: SampleJob | None = None,
            model_id: str | None = None,
            barrier: bool = False,
            **extra: Any,
        ) -> dict[str, Any]:
            rid = worker.submit(fn, sample, barrier)
            return {"request_id": rid, "model_id": model_id, **extra}

        @app.get("/api/v1/healthz")
        async def healthz() -> dict[str, Any]:
            return {"status": "ok"}

        @app.post("/api/v1/client/config")
        async def client_config() -> dict[str, Any]:
            return self.client_config

        @app.post("/api/v1/client/dynamic_config")
        async def dynamic_config() -> dict[str, Any]:
            return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

        @app.post("/api/v1/create_session")
        async def create_session(body: dict[str, Any]) -> dict[str, Any]:
            sid = f"session-{uuid.uuid4().hex[:16]}"
            self.sessions[sid] = {k: body.get(k) for k in ("user_metadata", "display_name")}
            return {"type": "create_session", "session_id": sid}

        @app.post("/api/v1/session_heartbeat")
        async def heartbeat(body: dict[str, Any]) -> Any:
            sid = str(body.get("session_id"))
            if sid in self._finished:
                return error(410, f"session {sid} has finished")
            return {"type": "session_heartbeat"}

        @app.post("/api/v1/telemetry")
        async def telemetry() -> dict[str, Any]:
            return {"status": "accepted"}

        @app.get("/api/v1/get_server_capabilities")
        async def capabilities() -> dict[str, Any]:
            return svc.capabilities()

        @app.post("/api/v1/create_model")
        async def create_model(body: dict[str, Any]) -> dict[str, Any]:
            model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
            base, lora = str(body["base_model"]), body.get("lora_config")
            meta = body.get("user_metadata")
            return future(
                lambda: svc.create_model(model_id, base, lora, user_metadata=meta),
                model_id=model_id,
            )

        @app.post("/api/v1/get_info")
        async def get_info(body: dict[str, Any]) -> dict[str, Any]:
            return svc.get_info(str(body["model_id"]))

        @app.post("/api/v1/unload_model")
        async def unload_model(body: dict[str, Any]) -> dict[str, Any]:
            mid = str(body["model_id"])
            return future(lambda: svc.unload_model(mid), model_id=mid)

        @app.post("/api/v1/forward_backward")
        async def forward_backward(request: Request) -> Any:
            raw = await request.body()
            if request.headers.get("content-encoding") == "zstd":
                import zstandard

                raw = zstandard.ZstdDecompressor().decompress(raw)
            try:
                fb = decode_forward_backward(raw)
            except WireError as e:
                return error(400, str(e))
            return future(lambda: svc.forward_backward(fb), model_id=fb.model_id)

        @app.post("/api/v1/optim_step")
        async def optim_step(body: dict[str, Any]) -> dict[str, Any]:
            mid = str(body["model_id"])
            params = body.get("adam_params") or body.get("optimizer_params") or {}
            return future(lambda: svc.optim_step(mid, params), model_id=mid)

        @app.post("/api/v1/save_weights")
        async def save_weights(body: dict[str, Any]) -> dict[str, Any]:
            mid, name = str(body["model_id"]), body.get("path")
            overwrite, own = bool(body.get("overwrite", False)), body.get("user_metadata")

            def save() -> dict[str, Any]:
                return svc.save_state(mid, name, overwrite=overwrite, user_metadata=own)

            return future(save, model_id=mid)

        @app.post("/api/v1/load_weights")
        async def load_weights(body: dict[str, Any]) -> dict[str, Any]:
            path, opt = str(body["path"]), bool(body.get("optimizer", False))
            if (
                body.get("session_id") is not None
            ):  # create-via-load (create_training_client_from_state)
                mid = f"{body['session_id']}:train:{int(body['model_seq_id'])}"
                base = body.get("base_model")
                return future(
                    lambda: svc.load_state(mid, path, opt, create=True, base_model=base),
                    model_id=mid,
                )
            mid = str(body["model_id"])
            return future(lambda: svc.load_state(mid, path, opt), model_id=mid)

        @app.post("/api/v1/save_weights_for_sampler")
        async def save_for_sampler(body: dict[str, Any]) -> dict[str, Any]:
            mid, name = str(body["model_id"]), body.get("path")

            def save() -> dict[str, Any]:
                out = svc.save_for_sampler(mid, name, body.get("user_metadata"))
                if "sampling_session_id" in out:  # an unnamed sampler of the model's session
                    session = mid.split(":train:")[0]
                    self.session_samplers.setdefault(session, []).append(
                        str(out["sampling_session_id"])
                    )
                return out

            # a named save changes what the samplers on its path serve: the sample requests
            # sent after it wait for it (those sent before are served the old weights)
            return future(save, model_id=mid, barrier=name is not None)

        @app.post("/api/v1/create_sampling_session")
        async def create_sampling_session(body: dict[str, Any]) -> dict[str, Any]:
            sid = svc.create_sampling_session(body.get("base_model"), body.get("model_path"))
            if body.get("session_id") is not None:
                self.session_samplers.setdefault(str(body["session_id"]), []).append(sid)
            return {"type": "create_sampling_session", "sampling_session_id": sid}

        @app.post("/api/v1/join_sampling_session")
        async def join_sampling_session(body: dict[str, Any]) -> dict[str, Any]:
            s = svc.sampler(str(body["sampling_session_id"]))
            s.clients += 1
            return {"type": "join_sampling_session", "client_counter": s.clients}

        @app.get("/api/v1/samplers/{sampler_id}")
        async def sampler_info(sampler_id: str) -> dict[str, Any]:
            s = svc.sampler(sampler_id)
            return {
                "sampler_id": s.sampler_id,
                "base_model": s.base.name,
                "model_path": s.model_path,
            }

        @app.post("/api/v1/asample")
        async def asample(body: dict[str, Any]) -> Any:
            if body.get("sampling_session_id"):  # checked by the job: a failed request
                sid = str(body["sampling_session_id"])
            else:  # a one-off request naming its weights
                sid = svc.create_sampling_session(body.get("base_model"), body.get("model_path"))
            topk = {k: body.get(k) or 0 for k in ("topk_prompt_logprobs", "topk_sample_logprobs")}
            for key, k in topk.items():
                if (why := check_k(key, k)) is not None:
                    return error(400, why)
            if body.get("prompt_alt_tokens_k"):  # random draws, not the most likely tokens
                return error(
                    400,
                    "prompt_alt_tokens_k is not supported by relayrl's Tinker service "
                    "(topk_prompt_logprobs gives the most likely tokens per prompt position)",
                )
            if body.get("target_prompt_logprobs") is not None:
                return error(400, "target_prompt_logprobs is not supported")
            chunks = body["prompt"]["chunks"]
            for c in chunks:
                if c.get("type", "encoded_text") != "encoded_text":
                    return error(
                        400,
                        f"{c.get('type')} chunks are not supported by relayrl's Tinker service "
                        "(text tokens only)",
                    )
            tokens = [t for c in chunks for t in c.get("tokens", [])]
            n = int(body.get("num_samples", 1))
            last_n = body.get("prompt_logprobs_last_n")
            job = SampleJob(
                sid,
                tokens,
                n,
                dict(body.get("sampling_params") or {}),
                bool(body.get("prompt_logprobs")),
                None if last_n is None else int(last_n),
                topk["topk_prompt_logprobs"],
                topk["topk_sample_logprobs"],
            )
            rid_seq = f"{sid}-{body.get('seq_id', uuid.uuid4().hex[:8])}"
            return future(sample=job, sample_sequence_ids=[f"{rid_seq}-{i}" for i in range(n)])

        @app.post("/api/v1/retrieve_future")
        async def retrieve_future(body: dict[str, Any]) -> Any:
            rid = str(body["request_id"])
            try:
                result: Result | None = await worker.wait(rid, POLL_S)
            except KeyError:
                return error(404, f"unknown request_id {rid!r}")
            if result is None:
                return {"type": "try_again", "request_id": rid, "queue_state": "active"}
            if isinstance(result, bytes):
                return Response(result, media_type=PROTO_CONTENT_TYPE)
            if isinstance(result, Exception):
                user = isinstance(result, UserError | ValueError)
                if not user:
                    log.exception("request %s failed", rid, exc_info=result)
                return {
                    "error": f"{type(result).__name__}: {result}",
                    "category": "user" if user else "server",
                }
            return result

        @app.post("/api/v1/sessions/{session_id}/finish")
        async def finish_session(session_id: str) -> dict[str, Any]:
            self._finished.add(session_id)
            return {}

        @app.post("/api/v1/cancel_future")
        async def cancel_future() -> dict[str, Any]:
            return {}

        @app.get("/api/v1/training_runs/{model_id}")
        async def get_training_run(model_id: str) -> dict[str, Any]:
            return training_run(svc, model_id)

        @app.get("/api/v1/training_runs/{model_id}/checkpoints")
        async def checkpoints(model_id: str) -> dict[str, Any]:
            return {"checkpoints": svc.store.list(model_id), "cursor": None}

        register_rest_routes(app, self)

        @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def unknown(rest: str) -> Any:
            log.warning("tinker-serve: no route for /%s", rest)
            return error(404, f"relayrl's Tinker service does not implement /{rest}")

        return app

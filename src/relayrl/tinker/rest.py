"""The SDK's ``RestClient`` routes for runs, checkpoints and sessions (direct answers).

Registered by :class:`~relayrl.tinker.server.TinkerServer` ahead of its catch-all route:

- ``GET training_runs?limit&offset`` (``list_training_runs``): the live training models and the
  model ids with checkpoints under the state directory (so runs of an earlier service, after a
  restart), sorted by id; ``project_id`` is refused (no projects here). ``GET
  training_runs/{id}`` (``get_training_run[_by_tinker_path]``) is the server's own route, with
  :func:`training_run`'s answer.
- ``POST weights_info`` (``get_weights_info_by_tinker_path``): base model, LoRA rank and the
  ``train_attn`` / ``train_mlp`` / ``train_unembed`` selection from the checkpoint's meta.json.
- ``DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}``
  (``delete_checkpoint[_from_tinker_path]``): an unknown checkpoint is 404 at once; otherwise the
  deletion is queued on the service's worker (after the work queued before it, so a save or
  load in flight finishes first), then renamed aside and removed
  (:meth:`~relayrl.tinker.checkpoints.CheckpointStore.delete`). The answer waits for it up to
  :data:`WAIT_S`; past that it is success, and the deletion happens when its turn comes.
- ``GET checkpoints?limit&offset`` (``list_user_checkpoints``): every checkpoint of every run,
  newest first.
- ``GET sessions?limit&offset`` (``list_sessions``): the sessions of this server, oldest first;
  ``GET sessions/{id}`` (``get_session``): its training runs (ids ``<session>:train:<n>``) and
  samplers.

Pagination: items ``offset .. offset + limit - 1`` of the sorted list; the cursor carries
``offset``, ``limit`` and ``total_count`` (the list's length). ``limit`` >= 1 and ``offset`` >= 0,
else 400.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relayrl.tinker.checkpoints import CheckpointError, CheckpointPath
from relayrl.tinker.service import LORA_GROUPS, TinkerService, UserError
from relayrl.tinker.worker import Worker


class RestHost(Protocol):
    """What the routes read of their server (``relayrl.tinker.server.TinkerServer``): the
    service, its worker, and the sessions it has seen (metadata; sampler ids)."""

    service: TinkerService
    worker: Worker
    sessions: dict[str, dict[str, Any]]
    session_samplers: dict[str, list[str]]


WAIT_S = 30.0
"""How long a delete waits for its turn on the worker (under the SDK's 60 s read timeout, past
which the SDK would send it again)."""


def error(status: int, message: str) -> JSONResponse:
    """A failed direct answer: the SDK raises its ``APIStatusError`` for ``status`` with it."""
    return JSONResponse({"detail": message, "error": message}, status_code=status)


def _int(request: Request, key: str, default: int, least: int) -> int:
    raw = request.query_params.get(key)
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        raise UserError(f"{key} must be an integer, got {raw!r}") from None
    if value < least:
        raise UserError(f"{key} must be >= {least}, got {value}")
    return value


def page(request: Request, items: list[Any], default_limit: int) -> tuple[list[Any], dict]:
    """``items[offset : offset + limit]`` and the SDK's ``Cursor``."""
    limit = _int(request, "limit", default_limit, 1)
    offset = _int(request, "offset", 0, 0)
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return items[offset : offset + limit], cursor


def run_ids(svc: TinkerService) -> list[str]:
    """Live training models and model ids with checkpoints on disk, sorted."""
    return sorted(set(list(svc.models)) | set(svc.store.model_ids()))


def training_run(svc: TinkerService, model_id: str) -> dict[str, Any]:
    """The SDK's ``TrainingRun`` of a live model, or of one known from its checkpoints (its
    ``user_metadata``: the run's; each listed checkpoint carries its own)."""
    ckpts = svc.store.list(model_id)
    if model_id in svc.models:
        tm = svc.models[model_id]
        base, rank, meta = tm.base.name, tm.rank, tm.user_metadata
    elif ckpts:
        _, m = svc.store.read(CheckpointPath.parse(ckpts[-1]["tinker_path"]))
        base, rank, meta = m["base_model"], m["rank"], m.get("user_metadata")
    else:
        raise UserError(f"unknown training run {model_id!r}")
    latest = {k: [c for c in ckpts if c["checkpoint_type"] == k] for k in ("training", "sampler")}
    return {
        "training_run_id": model_id,
        "base_model": base,
        "model_owner": "local",
        "is_lora": rank > 0,
        "lora_rank": rank or None,
        "last_request_time": datetime.now(UTC).isoformat(),
        "last_checkpoint": latest["training"][-1] if latest["training"] else None,
        "last_sampler_checkpoint": latest["sampler"][-1] if latest["sampler"] else None,
        "user_metadata": meta,
    }


def weights_info(svc: TinkerService, uri: str) -> dict[str, Any]:
    """The SDK's ``WeightsInfoResponse`` of a checkpoint, from its meta.json."""
    try:
        _, meta = svc.store.read(CheckpointPath.parse(uri))
    except CheckpointError as e:
        raise UserError(str(e).replace("no checkpoint at", "unknown checkpoint")) from e
    rank, targets = int(meta["rank"]), set(meta.get("targets") or [])
    info: dict[str, Any] = {
        "base_model": meta["base_model"],
        "is_lora": rank > 0,
        "lora_rank": rank or None,
    }
    if rank > 0:
        for flag, group in LORA_GROUPS.items():
            info[flag] = bool(targets & set(group))
    return info


def delete_checkpoint(svc: TinkerService, uri: str) -> dict[str, Any]:
    """Remove the checkpoint (a user error if it is not there) and forget its cached weights
    (a sampling client on it fails once it must reload them)."""
    try:
        svc.store.delete(CheckpointPath.parse(uri))
    except CheckpointError as e:
        raise UserError(str(e)) from e
    svc.forget_sampler_weights(uri)
    return {}


def register_rest_routes(app: FastAPI, server: RestHost) -> None:
    """Add the routes above to ``app`` (before the server's catch-all)."""
    svc, worker = server.service, server.worker

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request) -> Any:
        if request.query_params.get("project_id") is not None:
            return error(400, "relayrl's Tinker service has no projects: leave project_id out")
        ids, cursor = page(request, run_ids(svc), 20)
        runs = []
        for mid in ids:
            try:
                runs.append(training_run(svc, mid))
            except UserError:  # unloaded, without checkpoints, since listed
                continue
        return {"training_runs": runs, "cursor": cursor}

    @app.post("/api/v1/weights_info")
    async def get_weights_info(body: dict[str, Any]) -> Any:
        return weights_info(svc, str(body["tinker_path"]))

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete(model_id: str, checkpoint_id: str) -> Any:
        uri = f"tinker://{model_id}/{checkpoint_id}"
        try:
            path = CheckpointPath.parse(uri)
        except CheckpointError as e:
            return error(400, str(e))
        try:
            svc.store.deletable(path)
        except CheckpointError as e:
            return error(404, str(e))
        # a barrier: a sample request sent after the delete does not run ahead of it
        rid = worker.submit(lambda: delete_checkpoint(svc, uri), barrier=True)
        result = await worker.wait(rid, WAIT_S)
        if result is None:  # queued behind running work: deleted when its turn comes
            return None
        if isinstance(result, Exception):
            if isinstance(result, UserError):
                return error(404 if "unknown checkpoint" in str(result) else 400, str(result))
            raise result
        return None

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request) -> Any:
        everything = [c for mid in svc.store.model_ids() for c in svc.store.list(mid)]
        everything.sort(key=lambda c: str(c["time"]), reverse=True)
        checkpoints, cursor = page(request, everything, 100)
        return {"checkpoints": checkpoints, "cursor": cursor}

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request) -> Any:
        sessions, _ = page(request, list(server.sessions), 20)
        return {"sessions": sessions}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> Any:
        if session_id not in server.sessions:
            return error(404, f"unknown session {session_id!r}")
        prefix, meta = f"{session_id}:train:", server.sessions[session_id]
        user_metadata = meta.get("user_metadata")
        return {
            "training_run_ids": [m for m in run_ids(svc) if m.startswith(prefix)],
            "sampler_ids": list(server.session_samplers.get(session_id, [])),
            "user_metadata": (
                {str(k): str(v) for k, v in user_metadata.items()} if user_metadata else None
            ),
            "display_name": meta.get("display_name"),
        }

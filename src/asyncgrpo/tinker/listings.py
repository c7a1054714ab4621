"""The Tinker API's listings of runs, checkpoints and sessions, served from the database.

A program that resumes asks what was saved before: tinker-cookbook and `ServiceClient`
read a checkpoint's base model and LoRA shape with `weights_info`, and `RestClient` lists
training runs (the Tinker name of a training model) and their checkpoints. These answers
come from the database (`store.py`), so they hold everything saved in earlier server
processes too. The routes and what the SDK 0.38 validates in their answers
(`tinker.types`; unknown ids answer 404 with `{"error", "category": "user"}`):

| route | answer |
|---|---|
| GET training_runs?limit&offset | `TrainingRunsResponse{training_runs, cursor}`, newest first |
| GET training_runs/{model_id} | `TrainingRun{training_run_id, base_model, model_owner, is_lora, lora_rank, last_request_time, last_checkpoint?, last_sampler_checkpoint?}` |
| GET training_runs/{model_id}/checkpoints | `CheckpointsListResponse{checkpoints}`, newest first |
| DELETE training_runs/{model_id}/checkpoints/{kind}/{name} | removes the files and the record |
| GET checkpoints?limit&offset | `CheckpointsListResponse{checkpoints, cursor}`, every run's, newest first |
| POST weights_info `{tinker_path}` | `WeightsInfoResponse{base_model, is_lora, lora_rank, train_mlp, train_attn, train_unembed}` |
| GET sessions?limit&offset | `ListSessionsResponse{sessions}`, newest first |
| GET sessions/{session_id} | `GetSessionResponse{training_run_ids, sampler_ids}` |

A checkpoint's id is its path after the model id (`weights/<name>`, `sampler_weights/<name>`),
as the SDK's `ParsedCheckpointTinkerPath` splits it; its type is `training` or `sampler`.
A run's owner is the session that created it (one API key: no users here).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from asyncgrpo.tinker.checkpoints import SCHEME, parse_path
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.json_wire import read_field
from asyncgrpo.tinker.store import utc


class NotFound(TinkerUserError):
    """A listing asked for a run, checkpoint or session this server has no record of."""


def not_found_response(exc: NotFound) -> JSONResponse:
    return JSONResponse({"error": str(exc), "category": "user"}, status_code=404)


def _when(value) -> str:
    return utc(value).isoformat()


def checkpoint_json(row) -> dict:
    model_id, kind, name = parse_path(row.tinker_path)
    return {
        "checkpoint_id": f"{kind}/{name}",
        "checkpoint_type": row.kind,
        "time": _when(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": False,
    }


def training_run_json(model, saved: list) -> dict:
    """A `TrainingRun` of a model row, with the newest of its checkpoints (`saved`)."""
    newest = {}
    for row in sorted(saved, key=lambda r: utc(r.created_at)):
        newest[row.kind] = checkpoint_json(row)
    metadata = model.user_metadata
    return {
        "training_run_id": model.model_id,
        "base_model": model.base_model,
        "model_owner": model.session_id,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": model.lora_rank,
        "last_request_time": _when(model.last_request_at),
        "last_checkpoint": newest.get("training"),
        "last_sampler_checkpoint": newest.get("sampler"),
        # the SDK reads string values only
        "user_metadata": {str(k): _text(v) for k, v in metadata.items()} if metadata else None,
    }


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _cursor(offset: int, limit: int, total: int) -> dict:
    return {"offset": offset, "limit": limit, "total_count": total}


def routes() -> APIRouter:
    router = APIRouter()
    limit_query = Query(20, ge=1, le=1000)
    offset_query = Query(0, ge=0)

    @router.get("/training_runs")
    async def training_runs(request: Request, limit: int = limit_query, offset: int = offset_query):
        store = _store(request)
        rows, total = await asyncio.to_thread(store.models_page, limit, offset)
        saved = await asyncio.to_thread(store.checkpoints_of, [r.model_id for r in rows])
        runs = [training_run_json(r, [c for c in saved if c.model_id == r.model_id]) for r in rows]
        return {"training_runs": runs, "cursor": _cursor(offset, limit, total)}

    @router.get("/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request):
        model = await _model(request, model_id)
        saved = await asyncio.to_thread(_store(request).checkpoints_of, [model_id])
        return training_run_json(model, saved)

    @router.get("/training_runs/{model_id}/checkpoints")
    async def checkpoints_of_run(model_id: str, request: Request):
        await _model(request, model_id)
        saved = await asyncio.to_thread(_store(request).checkpoints_of, [model_id])
        return {"checkpoints": [checkpoint_json(row) for row in saved]}

    @router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request):
        await delete_saved(request.app.state.service, f"{SCHEME}{model_id}/{checkpoint_id}")
        return Response(status_code=204)

    @router.get("/checkpoints")
    async def all_checkpoints(
        request: Request, limit: int = Query(100, ge=1, le=1000), offset: int = offset_query
    ):
        rows, total = await asyncio.to_thread(_store(request).checkpoints_page, limit, offset)
        checkpoints = [checkpoint_json(row) for row in rows]
        return {"checkpoints": checkpoints, "cursor": _cursor(offset, limit, total)}

    @router.post("/weights_info")
    async def weights_info(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise TinkerUserError("body", f"not JSON: {exc}") from None
        path = read_field(body, "tinker_path", str)
        return await saved_weights_info(request.app.state.service, path)

    _session_listings(router, limit_query, offset_query)
    return router


def _session_listings(router: APIRouter, limit_query, offset_query) -> None:
    @router.get("/sessions")
    async def list_sessions(request: Request, limit: int = limit_query, offset: int = offset_query):
        rows, _ = await asyncio.to_thread(_store(request).sessions_page, limit, offset)
        return {"sessions": [row.session_id for row in rows]}

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        svc = request.app.state.service
        model_ids = await asyncio.to_thread(svc.store.session_model_ids, session_id)
        if model_ids is None:
            raise NotFound("session_id", f"no session {session_id!r} on this server")
        return {"training_run_ids": model_ids, "sampler_ids": svc.samplers.owned(session_id)}


def _store(request: Request):
    return request.app.state.service.store


async def _model(request: Request, model_id: str):
    model = await asyncio.to_thread(_store(request).model, model_id)
    if model is None:
        raise NotFound("model_id", f"no training run {model_id!r} on this server")
    return model


async def saved_weights_info(svc, path: str) -> dict:
    """The base model and LoRA shape a saved path was trained with: from the database, or,
    for a state saved before the server kept one, from the state's own JSON."""
    model_id, kind, _ = parse_path(path, "tinker_path")
    row = await asyncio.to_thread(svc.store.checkpoint, path)
    model = await asyncio.to_thread(svc.store.model, model_id) if row is not None else None
    if model is not None:
        spec = {
            "lora_rank": model.lora_rank,
            "train_mlp": model.train_mlp,
            "train_attn": model.train_attn,
            "train_unembed": model.train_unembed,
        }
        base_model = model.base_model
    elif kind == "weights" and svc.checkpoints.exists(path):
        saved_spec, base_model = await asyncio.to_thread(svc.checkpoints.saved_spec, path)
        spec = {"lora_rank": saved_spec["rank"]}
        spec.update({k: saved_spec[k] for k in ("train_mlp", "train_attn", "train_unembed")})
    else:
        raise NotFound("tinker_path", f"nothing is saved at {path!r} on this server")
    return {"base_model": base_model, "is_lora": True, **spec}


async def delete_saved(svc, path: str) -> None:
    """Remove a saved path's files and record (a sampler already created from it keeps its
    weights in memory)."""
    parse_path(path, "checkpoint_id")
    removed_files = await asyncio.to_thread(svc.checkpoints.delete, path)
    removed_rows = await asyncio.wrap_future(svc.store.checkpoint_deleted(path))
    svc.samplers.forget_path(path)
    if not removed_files and not removed_rows:
        raise NotFound("checkpoint_id", f"nothing is saved at {path!r} on this server")

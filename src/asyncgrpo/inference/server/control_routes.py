"""RL control routes (vLLM's names and shapes), all behind the admin token.

Pausing, aborting and replacing weights are what a trainer does to its engine;
nobody else may. Every route here requires `Authorization: Bearer <token>`
(compared in constant time). A server started without a token refuses them all
with 403, so an engine is never left open by accident.

A server that fronts a vLLM server (`asyncgrpo serve` with `engine.upstream_url`)
has no scheduler or weights of its own: the routes that pause, resume or
replace weights, or report their state, are refused there with a 409 naming the
vLLM server the trainer drives directly. `/abort_requests` aborts the requests
that server has running on vLLM.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict

from asyncgrpo.inference.engine.types import PauseMode, RequestError


def require_admin(request: Request) -> None:
    token = request.app.state.settings.admin_token
    if not token:
        raise HTTPException(
            403,
            "control routes are disabled: start the server with --admin-token "
            "or ASYNCGRPO_ADMIN_TOKEN",
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise HTTPException(
            401, "missing or wrong admin token", headers={"WWW-Authenticate": "Bearer"}
        )


def refuse_on_gateway(request: Request) -> None:
    """409 on a server whose engine is a vLLM server elsewhere (`RemoteEngine`)."""
    upstream = getattr(request.app.state.engine, "upstream_url", None)
    if upstream:
        raise RequestError(
            f"this server fronts vLLM at {upstream}; send pause, resume and weight updates "
            "(and ask for their state) there",
            409,
        )


router = APIRouter(dependencies=[Depends(require_admin)])
LOCAL_ENGINE = [Depends(refuse_on_gateway)]


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    init_info: dict[str, Any]


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    is_checkpoint_format: bool = True


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    update_info: dict[str, Any]


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    weight_version: int | None = None


@router.post("/pause", dependencies=LOCAL_ENGINE)
async def pause(request: Request, mode: PauseMode = PauseMode.ABORT, clear_cache: bool = True):
    """Like vLLM, the default mode is `abort`; `clear_cache` is accepted (no prefix cache here)."""
    await request.app.state.engine.pause(mode)
    return {"status": "paused", "mode": mode.value}


@router.post("/resume", dependencies=LOCAL_ENGINE)
async def resume(request: Request):
    await request.app.state.engine.resume()
    return {"status": "resumed"}


@router.get("/is_paused", dependencies=LOCAL_ENGINE)
async def is_paused(request: Request):
    return {"is_paused": request.app.state.engine.is_paused}


@router.post("/abort_requests")
async def abort_requests(request: Request):
    return {"aborted": request.app.state.engine.abort_all()}


@router.post("/reset_prefix_cache", dependencies=LOCAL_ENGINE)
async def reset_prefix_cache():
    return {"status": "ok"}  # the embedded engine keeps no prefix cache


@router.get("/get_world_size")
async def get_world_size():
    return {"world_size": 1}


@router.get("/weight_info", dependencies=LOCAL_ENGINE)
async def weight_info(request: Request):
    return {"weight_version": request.app.state.engine.weight_version}


@router.get("/server_info")
async def server_info(request: Request):
    engine = request.app.state.engine
    name = request.app.state.settings.served_model_name or engine.model_name
    dtype = str(engine.dtype).removeprefix("torch.")
    upstream = getattr(engine, "upstream_url", None)
    state = (
        {"upstream_url": upstream}  # versions and pauses are the vLLM server's
        if upstream
        else {
            "weight_version": engine.weight_version,
            "is_paused": engine.is_paused,
            "weight_transfer_backend": request.app.state.weights.backend,
        }
    )
    return {
        "model": name,
        "model_path": engine.model_name,
        "dtype": dtype,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.config.max_num_seqs,
        **state,
        "world_size": 1,
        "stats": engine.stats(),
        "engine_config": engine.config.model_dump(),  # every setting the engine runs with
        # the nesting vLLM's /server_info?config_format=json uses, for clients written for it
        "vllm_config": {
            "model_config": {
                "model": name,
                "dtype": f"torch.{dtype}",
                "max_model_len": engine.max_model_len,
            }
        },
    }


@router.post("/init_weight_transfer_engine", dependencies=LOCAL_ENGINE)
async def init_weight_transfer_engine(body: InitRequest, request: Request):
    request.app.state.weights.init(body.init_info)
    return {"status": "ok", "backend": request.app.state.weights.backend}


@router.post("/start_weight_update", dependencies=LOCAL_ENGINE)
async def start_weight_update(request: Request, body: StartRequest | None = None):
    request.app.state.weights.start()
    return {"status": "ok"}


@router.post("/update_weights", dependencies=LOCAL_ENGINE)
async def update_weights(request: Request):
    """JSON `{"update_info": {...}}` for shm/disk; a safetensors body for the http backend."""
    receiver = request.app.state.weights
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/octet-stream"):
        count = receiver.add_safetensors_bytes(await _read_body(request))
    else:
        try:
            body = UpdateRequest.model_validate_json(await request.body())
        except ValueError as exc:
            raise HTTPException(422, f"invalid update_weights body: {exc}") from None
        count = await receiver.add_description(body.update_info)
    return {"status": "ok", "tensors": count}


@router.post("/finish_weight_update", dependencies=LOCAL_ENGINE)
async def finish_weight_update(request: Request, body: FinishRequest | None = None):
    version = await request.app.state.weights.finish(body.weight_version if body else None)
    return {"status": "ok", "weight_version": version}


async def _read_body(request: Request) -> bytearray:
    """Read the body into one writable buffer (tensors are then views over it, no extra copy)."""
    declared = request.headers.get("content-length")
    if declared is None:
        buffer = bytearray()
        async for chunk in request.stream():
            buffer += chunk
        return buffer
    buffer, filled = bytearray(int(declared)), 0
    async for chunk in request.stream():
        if filled + len(chunk) > len(buffer):
            raise RequestError("request body longer than its Content-Length")
        buffer[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    if filled != len(buffer):
        raise RequestError(f"request body ended after {filled} of {len(buffer)} bytes")
    return buffer

"""The Tinker API's HTTP routes over a `TinkerService`, as the `tinker` SDK 0.38 calls them.

Every route but the health check needs the API key in `X-API-Key` (compared in constant
time). Bodies are size-limited before routing (`asyncgrpo.inference.server.limits`); a request the
server cannot even decode is answered 400 with `{"error", "category": "user"}`, which
the SDK raises at once; a decoded request that is wrong still takes its place in its
model's `seq_id` order and fails as a user error through its future, so the requests
queued behind it run. The routes and their bodies are the ones the SDK's resources call
and its types validate (`tinker.resources`, `tinker.types`); `wire.py` tabulates them.

The listings of saved runs and checkpoints (`training_runs`, `weights_info`, ...) are
answered from the database, so they hold what earlier server processes saved
(`listings.py`).

Every request is logged in one line (route, session, model, status, latency, and the reason
of a refusal) and counted for `GET /metrics` (Prometheus; open like the health check, see
`asyncgrpo.inference.server.metrics` for why; `tinker/metrics.py` for what it says).
"""

from __future__ import annotations

import hmac
import json
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from asyncgrpo.inference.server import metrics
from asyncgrpo.inference.server.limits import BodyLimitMiddleware
from asyncgrpo.inference.server.request_log import RequestObserver
from asyncgrpo.tinker import (
    json_wire,
    listings,
    sample_wire,
    sampling_ops,
    session_ops,
    state_ops,
    wire,
)
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import LONG_POLL_S
from asyncgrpo.tinker.service import TinkerService
from asyncgrpo.tinker.sessions import SessionEnded

PROTOBUF = "application/x-protobuf"
KEY_PREFIX = "tml-"
CLIENT_CONFIG = {
    # this server speaks plain HTTP with API keys, and polls futures one by one
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "proto_compress_fwdbwd": False,
}
DYNAMIC_CLIENT_CONFIG = {
    # the flags a live client re-fetches (`ClientDynamicConfigResponse`); nothing here changes
    # while the server runs, so the SDK's default period stands
    "refresh_interval_sec": 300,
    # no `/api/v1/cancel_future` here: an abandoned sample runs to its end, and a client gone
    # for `--session-ttl` has its samples' results dropped with its session
    "sample_cancel_enabled": False,
    "sample_cancel_max_batch_size": 64,
}


def create_app(service: TinkerService, api_key: str, long_poll_s: float = LONG_POLL_S) -> FastAPI:
    """The application; `api_key` must start with `tml-` (the SDK sends no other key)."""
    if not api_key.startswith(KEY_PREFIX):
        raise ValueError(
            f"the Tinker API key must start with {KEY_PREFIX!r}: the tinker SDK refuses to "
            "send any other key"
        )

    @asynccontextmanager
    async def lifespan(app):
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="asyncgrpo tinker-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service, app.state.api_key, app.state.long_poll_s = service, api_key, long_poll_s
    app.add_middleware(BodyLimitMiddleware, default_limit=service.limits.max_request_bytes)
    registry = metrics.new_registry()  # this application's own
    registry.register(service.metrics)
    app.add_middleware(RequestObserver, metrics=metrics.HttpMetrics(registry))  # outermost

    @app.exception_handler(TinkerUserError)
    async def user_error(request: Request, exc: TinkerUserError):
        return JSONResponse({"error": str(exc), "category": "user"}, status_code=400)

    @app.exception_handler(listings.NotFound)
    async def not_found(request: Request, exc: listings.NotFound):
        return listings.not_found_response(exc)

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return metrics.metrics_response(registry)

    for routes in (_session_routes, _training_routes, _sampling_routes, listings.routes):
        app.include_router(routes(), prefix="/api/v1", dependencies=[Depends(require_key)])
    return app


def require_key(request: Request) -> None:
    given = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), request.app.state.api_key.encode()):
        hint = (
            ""
            if given.startswith(KEY_PREFIX)
            else f" (the SDK sends only keys starting {KEY_PREFIX!r})"
        )
        raise HTTPException(401, f"missing or wrong API key{hint}")


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise TinkerUserError("body", f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise TinkerUserError("body", "must be a JSON object")
    return body


def service(request: Request) -> TinkerService:
    return request.app.state.service


def _session_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @router.post("/client/dynamic_config")
    async def client_dynamic_config():
        return DYNAMIC_CLIENT_CONFIG

    @router.post("/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @router.post("/create_session")
    async def create_session(request: Request):
        metadata = json_wire.read_field(await _json(request), "user_metadata", dict, default=None)
        return await session_ops.create_session(service(request), metadata)

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request):
        try:
            service(request).session(str((await _json(request)).get("session_id")))
        except SessionEnded as exc:  # 410 is what stops the SDK's heartbeat loop
            return JSONResponse({"error": str(exc), "category": "user"}, status_code=410)
        return {"type": "session_heartbeat"}

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        session_ops.finish_session(service(request), session_id)
        return {}

    @router.get("/get_server_capabilities")
    async def capabilities(request: Request):
        served = service(request).served
        return {
            "supported_models": [
                {"model_name": served.name, "max_context_length": served.max_length}
            ]
        }

    return router


def _training_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/create_model")
    async def create_model(request: Request):
        svc = service(request)
        return svc.create_model(json_wire.decode_create_model(await _json(request), svc.limits))

    @router.post("/get_info")
    async def get_info(request: Request):
        return service(request).get_info(str((await _json(request)).get("model_id")))

    @router.post("/forward_backward")
    async def forward_backward(request: Request):
        svc, body = service(request), await request.body()
        return _in_turn(
            svc, lambda: svc.forward_backward(wire.decode_forward_backward(body, svc.limits))
        )

    @router.post("/optim_step")
    async def optim_step(request: Request):
        svc, body = service(request), await _json(request)
        return _in_turn(svc, lambda: svc.optim_step(json_wire.decode_optim_step(body)))

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        return sampling_ops.save_weights_for_sampler(service(request), await _json(request))

    @router.post("/save_weights")
    async def save_weights(request: Request):
        return state_ops.save_weights(service(request), await _json(request))

    @router.post("/load_weights")
    async def load_weights(request: Request):
        return state_ops.load_weights(service(request), await _json(request))

    router.add_api_route(
        "/save_weights_external", _not_yet("save_weights_external"), methods=["POST"]
    )
    return router


def _sampling_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request):
        return sampling_ops.create_sampling_session(service(request), await _json(request))

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return sampling_ops.get_sampler(service(request), sampler_id)

    @router.post("/asample")
    async def asample(request: Request):
        svc = service(request)
        call = sample_wire.decode_sample_request(await _json(request), svc.limits)
        return sampling_ops.sample(svc, call)

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = str((await _json(request)).get("request_id"))
        try:
            outcome = await service(request).retrieve(request_id, request.app.state.long_poll_s)
        except KeyError:
            raise TinkerUserError("request_id", f"unknown request {request_id!r}") from None
        if outcome is None:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if outcome.error is not None:
            return outcome.error
        if outcome.proto is not None:
            return Response(outcome.proto, media_type=PROTOBUF)
        return outcome.json

    return router


def _in_turn(svc: TinkerService, submit):
    """`submit()`, or, when the request is refused once its seq_id is known, its failure
    queued in turn (see `TinkerService.fail_in_turn`)."""
    try:
        return submit()
    except TinkerUserError as exc:
        if exc.request_key is None:
            raise
        return svc.fail_in_turn(exc)


def _not_yet(route: str):
    async def refuse():
        raise TinkerUserError(route, f"{route} is not served by asyncgrpo tinker-serve yet")

    return refuse

"""The engine's HTTP server: OpenAI routes and RL control routes over one embedded engine.

`create_app(engine, settings)` builds the FastAPI application; `asyncgrpo
serve` (cli.py) loads the model and runs it under uvicorn. The engine thread is
started and stopped with the application, so a test can run the same app
in-process. Connection limits and timeouts are set where uvicorn runs it
(`connections.py`). Request bodies are size-limited before routing; every error,
including a failing engine, becomes a JSON error response and the next request
is served normally. Every request is counted for `GET /metrics` and logged in one line
on the `asyncgrpo.requests` logger (shown from `--log-level info`: `request_log.py`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.server import control_routes, episodes, metrics, openai_routes
from asyncgrpo.inference.server.errors import install_error_handlers
from asyncgrpo.inference.server.limits import BodyLimitMiddleware
from asyncgrpo.inference.server.request_log import RequestObserver
from asyncgrpo.inference.server.toolcalls import get_parser
from asyncgrpo.inference.server.weights import WeightReceiver

MiB = 2**20


@dataclass
class ServerSettings:
    admin_token: str | None = None
    """Bearer token for the control routes; without one they are refused (403)."""
    served_model_name: str | None = None
    """Name reported by /v1/models and accepted as `model` (default: the model path)."""
    max_body_bytes: int = 16 * MiB
    """Largest request body on every route but the weight upload (413 beyond)."""
    max_weight_body_bytes: int = 4096 * MiB
    """Largest body of POST /update_weights (the `http` backend sends weights in it)."""
    tool_parser: str = "hermes"
    """How tool calls are read out of generated text (`asyncgrpo.inference.server.toolcalls` registry)."""
    max_open_episodes: int = 1024
    """Agent episodes open at once; opening one more is refused (503) until some close."""
    episode_idle_timeout_s: float = 900.0
    """An episode with no call for this long is closed (its samples are dropped)."""
    max_episode_turns: int = 1000
    """Calls one episode may make, whatever the episode asked for when it was opened."""
    weights_dir: str | None = None
    """Where the `disk` weight backend may read (see `EmbeddedEngineConfig.weights_dir`)."""
    body_timeout_s: float = 30.0
    """Deadline of a request body after its header (per piece on /update_weights)."""

    @classmethod
    def from_config(
        cls, cfg: EmbeddedEngineConfig, admin_token: str | None, default_name: str
    ) -> ServerSettings:
        """The server part of an engine's config (the token never travels in it)."""
        return cls(
            admin_token=admin_token,
            served_model_name=cfg.served_model_name or default_name,
            max_body_bytes=int(cfg.max_body_mb * MiB),
            max_weight_body_bytes=int(cfg.max_weight_body_mb * MiB),
            tool_parser=cfg.tool_parser,
            max_open_episodes=cfg.max_open_episodes,
            episode_idle_timeout_s=cfg.episode_idle_timeout_s,
            weights_dir=cfg.weights_dir,
            body_timeout_s=cfg.body_timeout_s,
        )


def create_app(engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="asyncgrpo engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.settings = settings
    app.state.weights = WeightReceiver(engine, settings.weights_dir)
    app.state.started = int(time.time())
    app.state.tool_parser = get_parser(settings.tool_parser)
    app.state.episodes = episodes.EpisodeRegistry(
        settings.max_open_episodes, settings.episode_idle_timeout_s, settings.max_episode_turns
    )
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(control_routes.router)
    app.include_router(episodes.admin_router)
    app.include_router(episodes.router)
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=settings.max_body_bytes,
        limits={"/update_weights": settings.max_weight_body_bytes},
        timeout_s=settings.body_timeout_s,
        per_piece=("/update_weights",),
    )
    observe(app, engine)  # last: outermost, so refusals by the layers above count too
    return app


def observe(app: FastAPI, engine) -> None:
    """`GET /metrics` (requests, latencies, the engine's counters) and the request log."""
    registry = metrics.new_registry()
    http = None
    if registry is not None:
        http = metrics.HttpMetrics(registry)
        registry.register(metrics.StateCollector(lambda: metrics.engine_families(engine)))
    app.state.metrics_registry = registry
    app.add_middleware(RequestObserver, metrics=http)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request):
        return metrics.metrics_response(request.app.state.metrics_registry)

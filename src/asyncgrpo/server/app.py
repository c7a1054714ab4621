"""The engine's HTTP server: OpenAI routes and RL control routes over one embedded engine.

`create_app(engine, settings)` builds the FastAPI application; `asyncgrpo
serve` (cli.py) loads the model and runs it under uvicorn. The engine thread is
started and stopped with the application, so a test can run the same app
in-process. Request bodies are size-limited before routing; every error,
including a failing engine, becomes a JSON error response and the next request
is served normally.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from asyncgrpo.server import control_routes, openai_routes
from asyncgrpo.server.errors import install_error_handlers
from asyncgrpo.server.limits import BodyLimitMiddleware
from asyncgrpo.server.weights import WeightReceiver

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
    app.state.weights = WeightReceiver(engine)
    app.state.started = int(time.time())
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(control_routes.router)
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=settings.max_body_bytes,
        limits={"/update_weights": settings.max_weight_body_bytes},
    )
    return app

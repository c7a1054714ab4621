"""Async client for the engine protocol (embedded engine and vLLM alike)."""

from asyncgrpo.client.engine_client import (
    Completion,
    Continuation,
    EngineClient,
    EngineProtocolError,
)
from asyncgrpo.client.retry import EngineHTTPError, EngineUnavailableError, RetryPolicy

__all__ = [
    "Completion",
    "EngineClient",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineUnavailableError",
    "RetryPolicy",
    "Continuation",
]

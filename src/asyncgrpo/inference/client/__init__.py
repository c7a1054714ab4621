"""Async client for the engine protocol (embedded engine and vLLM alike)."""

from asyncgrpo.base.engine_errors import EngineProtocolError, EngineRefused, EngineUnavailable
from asyncgrpo.inference.client.engine_client import Completion, Continuation, EngineClient
from asyncgrpo.inference.client.retry import RetryPolicy

__all__ = [
    "Completion",
    "EngineClient",
    "EngineRefused",
    "EngineProtocolError",
    "EngineUnavailable",
    "RetryPolicy",
    "Continuation",
]

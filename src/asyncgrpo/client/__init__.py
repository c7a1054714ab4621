"""Async client for the engine protocol (embedded engine and vLLM alike)."""

from asyncgrpo.client.engine_client import Completion, Continuation, EngineClient
from asyncgrpo.client.retry import RetryPolicy
from asyncgrpo.engine_errors import EngineProtocolError, EngineRefused, EngineUnavailable

__all__ = [
    "Completion",
    "EngineClient",
    "EngineRefused",
    "EngineProtocolError",
    "EngineUnavailable",
    "RetryPolicy",
    "Continuation",
]

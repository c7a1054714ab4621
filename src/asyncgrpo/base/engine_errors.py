"""What can go wrong with an inference engine, as the side that uses it sees it: one family.

Every engine the run drives (embedded, external, vLLM, a replica of either) fails
in the same few ways, and callers tell them apart by class, not by message:

    EngineFailure
      EngineStartError      it did not start, or was not ready in time
      EngineDied            it died and could not be brought back
      EngineLostInSync      it died during a weight sync (the sync is repeated after a restart)
      SyncTimeout           a weight sync missed engine.sync_timeout_s (stalled, not dead)
      EngineCallError       one call failed:
        EngineRefused         the engine refused the request (4xx): never retried
        EngineUnavailable     unreachable, or 5xx until the retries ran out
        EngineProtocolError   a 2xx answer that breaks the protocol

The engine's own refusal of a request, inside its server, is not part of this
family: that is `engine.types.RequestError`, the HTTP answer that a client then
sees as `EngineRefused` or `EngineUnavailable`.
"""

from __future__ import annotations


class EngineFailure(RuntimeError):
    """Anything that goes wrong with an engine, seen from its user."""


class EngineStartError(EngineFailure):
    """The engine did not start, or was not ready in time."""


class EngineDied(EngineFailure):
    """The engine died and could not be brought back (restarts exhausted or impossible)."""


class EngineLostInSync(EngineFailure):
    """The engine process died during a weight sync."""


class SyncTimeout(EngineFailure):
    """A weight sync missed `engine.sync_timeout_s` (the engine stalled without dying)."""


class EngineCallError(EngineFailure):
    """One call to the engine failed."""


class EngineRefused(EngineCallError):
    """The engine refused a request (4xx). Not retried: the same request would fail again."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class EngineUnavailable(EngineCallError):
    """The engine could not be reached, or kept failing (5xx), until the retry budget ran out."""

    def __init__(self, message: str, status: int | None = None, attempts: int = 0):
        super().__init__(message)
        self.message = message
        self.status = status
        self.attempts = attempts


class EngineProtocolError(EngineCallError):
    """The server answered 2xx with a body that breaks the protocol (e.g. lengths disagree)."""

"""Request-body size limits, enforced before any route reads a byte.

A generation request is a few kilobytes; a megabyte-sized JSON body is a bug or
an attack, and uvicorn itself sets no limit. Each path has a limit (the `http`
weight route a much larger one, since its body is a safetensors image); a
larger body gets 413 with a JSON error. A declared `Content-Length` is checked
up front; a chunked body is counted as it arrives and buffered only up to the
limit.
"""

from __future__ import annotations

import json

from asyncgrpo.server.errors import error_body

DRAIN_LIMIT = 256 * 2**20  # read and discard at most this much of a refused body


class BodyLimitMiddleware:
    """ASGI middleware: 413 for bodies over `limits.get(path, default_limit)` bytes."""

    def __init__(self, app, default_limit: int, limits: dict[str, int] | None = None):
        self.app = app
        self.default_limit = default_limit
        self.limits = limits or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.get(scope["path"], self.default_limit)
        declared = _content_length(scope)
        if declared is not None:
            if declared > limit:
                await _drain(receive, min(declared, DRAIN_LIMIT))
                return await _refuse(send, limit)
            return await self.app(scope, receive, send)
        # chunked (or no) body: buffer it up to the limit, then replay it
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                if message.get("more_body"):
                    await _drain(receive, DRAIN_LIMIT)
                return await _refuse(send, limit)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive, budget: int) -> None:
    """Read what the client is still sending so it sees our answer instead of a reset."""
    seen = 0
    while seen <= budget:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send, limit: int) -> None:
    body = json.dumps(
        error_body(f"request body exceeds the limit of {limit} bytes ({limit / 2**20:g} MiB)", 413)
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

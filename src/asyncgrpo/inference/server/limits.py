"""Request-body size limits, enforced before any route reads a byte.

A generation request is a few kilobytes; a megabyte-sized JSON body is a bug or
an attack, and uvicorn itself sets no limit. Each path has a limit (the `http`
weight route a much larger one, since its body is a safetensors image); a
larger body gets 413 with a JSON error. A declared `Content-Length` is checked
up front; a chunked body is counted as it arrives and buffered only up to the
limit.

A body must also arrive in time: within `timeout_s` of its header (a client that
sends a header and then trickles or withholds the body would otherwise hold its
connection forever), or, on the weight upload, within `timeout_s` of its previous
piece. Late bodies get 408 and the connection is closed. Once the body is in,
`receive` is passed through as is: a streaming route waits on it for the client
to disconnect.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.exceptions import HTTPException

from asyncgrpo.inference.server.errors import error_body

DRAIN_LIMIT = 256 * 2**20  # read and discard at most this much of a refused body


class BodyLimitMiddleware:
    """ASGI middleware: 413 for bodies over `limits.get(path, default_limit)` bytes."""

    def __init__(
        self,
        app,
        default_limit: int,
        limits: dict[str, int] | None = None,
        timeout_s: float = 30.0,
        per_piece: tuple[str, ...] = (),
    ):
        self.app = app
        self.default_limit = default_limit
        self.limits = limits or {}
        self.timeout_s = timeout_s
        self.per_piece = per_piece

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.get(scope["path"], self.default_limit)
        receive = BodyDeadline(receive, self.timeout_s, scope["path"] in self.per_piece)
        declared = _content_length(scope)
        if declared is not None:
            if declared > limit:
                await _drain(receive, min(declared, DRAIN_LIMIT))
                return await _refuse(send, limit)
            return await self.app(scope, receive, send)
        try:
            chunks = await _read_chunked(receive, limit)
        except HTTPException as exc:  # late: the app never saw this request
            return await _respond(send, exc.status_code, str(exc.detail), exc.headers)
        if chunks is None:
            return await _refuse(send, limit)
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class BodyDeadline:
    """`receive` with a deadline on the request body (408 and close after it)."""

    def __init__(self, receive, timeout_s: float, per_piece: bool):
        self.receive = receive
        self.timeout_s = timeout_s
        self.per_piece = per_piece
        self.deadline = time.monotonic() + timeout_s
        self.complete = False

    async def __call__(self):
        if self.complete:
            return await self.receive()
        now = time.monotonic()
        if self.per_piece:
            self.deadline = now + self.timeout_s
        try:
            message = await asyncio.wait_for(self.receive(), max(0.0, self.deadline - now))
        except TimeoutError:
            raise HTTPException(
                408,
                f"request body not complete within {self.timeout_s:g}s (engine.body_timeout_s)",
                headers={"connection": "close"},
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.complete = True
        return message


async def _read_chunked(receive, limit: int) -> list[bytes] | None:
    """A chunked (or absent) body, read up to `limit` bytes; None beyond it (drained)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return chunks
        size += len(message.get("body", b""))
        if size > limit:
            if message.get("more_body"):
                await _drain(receive, DRAIN_LIMIT)
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks


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
        try:
            message = await receive()
        except HTTPException:  # the body stopped coming: refuse it all the same
            return
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send, limit: int) -> None:
    message = f"request body exceeds the limit of {limit} bytes ({limit / 2**20:g} MiB)"
    await _respond(send, 413, message)


async def _respond(send, status: int, message: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

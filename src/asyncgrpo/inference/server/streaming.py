"""Client disconnects end generation: for streamed and for plain responses.

A client that goes away (timeout, crash, Ctrl-C, an agent framework giving up)
must not leave its request decoding in a KV-cache slot. For streams, Starlette
cancels the response when the client disconnects; `EventStream` additionally
closes the body generator whatever happens, which closes the engine generator
and aborts the request. A plain (non-streamed) request would otherwise run to
the end unobserved, so `cancel_on_disconnect` watches the connection while the
work runs and cancels the work when the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

T = TypeVar("T")


def sse(data: dict | str) -> str:
    """One server-sent event carrying JSON (or the literal `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class EventStream(StreamingResponse):
    """`text/event-stream` whose body generator is always closed when the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    return task.result()

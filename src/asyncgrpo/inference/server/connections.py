"""Connection limits for `asyncgrpo serve`: a deadline on every request header, a cap on sockets.

uvicorn (h11) times out a connection only while it idles *after* a response
(`timeout_keep_alive`): a socket that connects and never completes a request
header is kept forever. 1,100 such sockets used up the process's file
descriptors and denied service. Its `limit_concurrency` does not help: it
answers 503 to *requests* once that many connections are open and closes
nothing, so idle sockets would make the server refuse everyone. Hence a small
subclass of uvicorn's h11 protocol, handed to `uvicorn.Config(http=...)`:

- a header deadline: a request header must be complete `header_timeout_s` after
  the connection opens, or after its first byte following a keep-alive wait;
  otherwise the socket is closed (after a 408 if part of a header came);
- a connection cap: beyond `max_connections`, the connection that has waited
  longest for a request (idle, keep-alive or slow header) is closed to make
  room, so an idle flood cannot lock clients out; when every connection has a
  request in flight, the new one is answered 503 and closed.

Idle keep-alive connections still close after uvicorn's `timeout_keep_alive`
(`keep_alive_timeout_s`); a request header is limited to h11's 16 KiB. uvicorn's
`backlog` (2048) stays: connections queued by the kernel cost no descriptors of
ours, and the cap applies as they are accepted. `raise_fd_limit` lifts the soft
open-file limit at start, so that the cap, not the descriptor limit, is what bites.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.server.request_log import configure_request_log

logger = logging.getLogger("uvicorn.error")

FD_RESERVE = 256  # descriptors kept for model files, logs, weight segments and threads
MAX_HEADER_BYTES = 16 * 1024  # h11's own default, stated: a longer request header is a 400


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # e.g. beyond the kernel's nr_open
        return soft, soft
    return soft, target


def connection_cap(max_connections: int, fd_limit: int) -> int:
    """`max_connections`, lowered so that the connections leave `FD_RESERVE` descriptors free."""
    if fd_limit == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, fd_limit - FD_RESERVE))


def run_server(
    app,
    cfg: EmbeddedEngineConfig,
    *,
    host: str,
    port: int,
    log_level: str,
    log_format: str = "text",
    request_log_level: str | None = None,
    log_also: tuple[str, ...] = (),
) -> None:
    """Serve `app` with the connection limits of `cfg`, until interrupted. The request
    lines (`request_log.py`) and the loggers `log_also` go to stderr as `log_format`
    from `request_log_level` up (default: `log_level`, uvicorn's)."""
    import uvicorn

    configure_request_log(log_format, request_log_level or log_level, loggers=log_also)
    before, after = raise_fd_limit()
    cap = connection_cap(cfg.max_connections, after)
    note = "" if cap == cfg.max_connections else f" (max_connections {cfg.max_connections})"
    print(
        f"asyncgrpo serve: open-file limit {before} -> {after}; at most {cap} connections{note}, "
        f"header timeout {cfg.header_timeout_s:g}s, keep-alive {cfg.keep_alive_timeout_s:g}s",
        flush=True,
    )
    limits = ConnectionLimits(cap, cfg.header_timeout_s)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        http=functools.partial(BoundedH11Protocol, limits=limits),
        ws="none",  # no websocket routes; an upgraded socket would also leave the count
        timeout_keep_alive=cfg.keep_alive_timeout_s,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=5,
    )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-header deadline and a connection cap."""

    last_refusal_logged = float("-inf")  # loop time of the last "connection refused" warning

    def __init__(self, config, server_state, app_state, _loop=None, *, limits: ConnectionLimits):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.waiting_since: float | None = None  # loop time it began waiting for a request
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if not self._make_room():
            self._log_refusal()
            message = f"server at its connection limit ({self.limits.max_connections}); retry"
            transport.write(_plain_response(503, "Service Unavailable", message))
            transport.close()
            return
        self.waiting_since = self.loop.time()
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # cancels uvicorn's keep-alive timer
        if self.conn.their_state is not h11.IDLE:  # a whole header came (or a 400 was sent)
            self._stop_waiting()
        elif self.header_timer is None:  # first bytes after a keep-alive wait
            self._start_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.waiting_since = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _log_refusal(self) -> None:
        """A warning at most once a second: a flood of refusals must not flood the log."""
        now = self.loop.time()
        if now - BoundedH11Protocol.last_refusal_logged >= 1.0:
            BoundedH11Protocol.last_refusal_logged = now
            logger.warning(
                "connection refused: %d connections open, every one with a request in flight",
                self.limits.max_connections,
            )

    def _start_header_timer(self) -> None:
        if not self.transport.is_closing():
            self.header_timer = self.loop.call_later(
                self.limits.header_timeout_s, self._header_timed_out
            )

    def _stop_waiting(self) -> None:
        self.waiting_since = None
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a header came: say why before closing
            message = f"request header not complete within {self.limits.header_timeout_s:g}s"
            self.transport.write(_plain_response(408, "Request Timeout", message))
        self.transport.close()

    def _make_room(self) -> bool:
        """Over the cap, close the connection waiting longest for a request; False if none is."""
        if len(self.connections) <= self.limits.max_connections:  # closing ones included
            return True
        open_now = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_now) <= self.limits.max_connections:
            return True
        waiting = [c for c in open_now if getattr(c, "waiting_since", None) is not None]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.waiting_since).transport.close()
        return True


def _plain_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 response that closes the connection (written without h11)."""
    body = message.encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body

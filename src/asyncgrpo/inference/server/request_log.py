"""One log line per HTTP request, and the request counters of `GET /metrics`.

A server that logs nothing per request can only be debugged from its clients: a client
whose every request was refused (a `max_tokens` beyond the context, a wrong key) looks,
from the server, like a quiet afternoon. `RequestObserver` wraps an application and, when
each request ends, counts it (`HttpMetrics`) and logs one line on the `asyncgrpo.requests`
logger: method, route, status, latency, what the request was about (a route or the code
behind it adds fields with `note`, e.g. the session and model), and for a refusal
(status 400 to 499) the reason the client got, read from the error body, as `refused` (a
5xx's as `error`). A refusal sent with HTTP 200 (the Tinker API fails a future that way) is
noted by its route. A client that disconnects while sending its request (killed mid-body)
is logged and counted as 499, as nginx does, not as a 500 with a traceback: nothing was
answered, and no server fault happened.

The line is text (`key=value`, values with spaces quoted) or one JSON object
(`configure_request_log`). Nothing is formatted when the logger would drop the line.
The route is the matched route's template (`/v1/models/{model}`), so that the counters
have one series per route; a path answered before routing (a body too large) or by no
route is logged as sent and counted as "unrouted".
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

from starlette.requests import ClientDisconnect

REQUEST_LOGGER = "asyncgrpo.requests"
CLIENT_CLOSED = 499  # nginx's status for a request its client abandoned: nothing was answered
REASON_BYTES = 4096  # of an error body read for its reason
UNROUTED = "unrouted"

_notes: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "asyncgrpo_request_notes", default=None
)
logger = logging.getLogger(REQUEST_LOGGER)


def note(**fields: Any) -> None:
    """Add fields to the log line of the request being served (none outside a request)."""
    notes = _notes.get()
    if notes is not None:
        notes.update(fields)


class RequestObserver:
    """ASGI middleware: counts every HTTP request and logs one line when it ends."""

    def __init__(self, app, metrics=None):
        """`metrics`: an `HttpMetrics`, or None to only log."""
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        notes: dict[str, Any] = {}
        token = _notes.set(notes)
        status, error_body = 500, bytearray()  # 500 unless a response starts
        started = False

        async def observing_send(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            elif message["type"] == "http.response.body" and status >= 400:
                error_body.extend(message.get("body", b"")[: REASON_BYTES - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        except ClientDisconnect:
            if started:
                raise
            # the client left while sending its request: no one to answer, no server error
            status = CLIENT_CLOSED
            notes.setdefault("refused", "the client disconnected while sending its request")
        except Exception as exc:
            notes.setdefault("error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            _notes.reset(token)
            self._observe(scope, status, time.perf_counter() - start, notes, error_body)

    def _observe(self, scope, status: int, seconds: float, notes: dict, body: bytes) -> None:
        template = route_template(scope)
        if self.metrics is not None:
            self.metrics.observe(template or UNROUTED, scope["method"], status, seconds)
        if not logger.isEnabledFor(logging.INFO):
            return
        fields = {
            "method": scope["method"],
            "route": template or scope["path"][:200],
            "status": status,
            "latency_ms": round(seconds * 1000, 2),
            **notes,
        }
        reason_key = "refused" if status < 500 else "error"
        if status >= 400 and reason_key not in fields:
            fields[reason_key] = refusal_reason(body)
        logger.info(text_line(fields), extra={"request": fields})


def route_template(scope) -> str | None:
    """The path with each path parameter's value put back as `{name}`, once a route has
    matched (None before or without one). Read from the path, not the route object: a
    route of an included router knows only its path within that router."""
    if scope.get("route") is None:
        return None
    path = scope["path"]
    for name, value in scope.get("path_params", {}).items():
        if str(value):
            path = path.replace(f"/{value}", f"/{{{name}}}", 1)
    return path


def refusal_reason(body: bytes) -> str:
    """The message of an error body: Tinker's `{"error": str}`, OpenAI's `{"error":
    {"message"}}`, FastAPI's `{"detail"}`, or the text itself."""
    text = bytes(body).decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(no body)"
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed.get("detail"))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:2000]
    return text[:500]


def text_line(fields: dict[str, Any]) -> str:
    """`POST /route 200 1.2ms key=value ...`, values with spaces or quotes JSON-quoted."""
    head = f"{fields['method']} {fields['route']} {fields['status']} {fields['latency_ms']}ms"
    rest = []
    for key, value in fields.items():
        if key in ("method", "route", "status", "latency_ms") or value is None:
            continue
        value = str(value)
        if not value or any(c in value for c in ' "=\n\t'):
            value = json.dumps(value)
        rest.append(f"{key}={value}")
    return " ".join([head, *rest])


class JsonLineFormatter(logging.Formatter):
    """A log record as one JSON object: time, level, logger, and a request line's fields
    (or the message of any other record)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "request", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_request_log(
    log_format: str = "text", level: str | int = "info", loggers: tuple[str, ...] = ()
) -> logging.Handler:
    """Send the request lines (and the records of `loggers`) to stderr as `log_format`
    ("text" or "json"), from `level` up; the handler (one per logger, replaced when
    called again)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLineFormatter() if log_format == "json" else logging.Formatter(_TEXT_FORMAT)
    )
    handler.set_name("asyncgrpo-request-log")
    level = level.upper() if isinstance(level, str) else level
    for name in (REQUEST_LOGGER, *loggers):
        target = logging.getLogger(name)
        for old in [h for h in target.handlers if h.get_name() == handler.get_name()]:
            target.removeHandler(old)
        target.addHandler(handler)
        target.setLevel(level)
        target.propagate = False
    return handler

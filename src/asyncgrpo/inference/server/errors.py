"""Every failure becomes a JSON error in OpenAI's shape; none reaches the engine loop.

`{"error": {"message", "type", "param", "code"}}` is what the `openai` client
parses into its exception classes (and what vLLM returns), so a 400 for an
over-long prompt surfaces as `BadRequestError` with our message. A bad value is
a 400 naming the field in `param`; a body that does not parse or has a field of
the wrong type is a 422 (FastAPI's convention).

An unexpected exception is answered by `InternalErrorMiddleware`, not by an
`Exception` handler: Starlette sends that handler's response and then re-raises,
and uvicorn closes the keep-alive connection, so a client's next request on it
fails. The middleware logs the traceback once and the connection stays usable.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from asyncgrpo.inference.engine.types import RequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class ErrorResponse(JSONResponse):
    """JSON in ASCII: a message quoting the client's input (a lone surrogate in a model
    name, say) must still encode, or the error would become a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(
    message: str, status: int, headers: dict | None = None, param=None
) -> JSONResponse:
    return ErrorResponse(error_body(message, status, param), status_code=status, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message of a 422 and the field it names first (its `param`)."""
    parts, fields = [], []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
        fields.append(where)
    return "invalid request: " + "; ".join(parts), (fields[0] if fields else None)


class InternalErrorMiddleware:
    """ASGI middleware: an unexpected exception becomes a logged JSON 500 on a live connection.

    Once a response has started (a stream failing half-way), nothing can be said
    in its place: the exception goes on and the server ends the connection.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            response = error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def engine_error(request: Request, exc: RequestError):
        return error_response(exc.message, exc.status, param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = describe_validation_error(exc)
        return error_response(message, 422, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    app.add_middleware(InternalErrorMiddleware)

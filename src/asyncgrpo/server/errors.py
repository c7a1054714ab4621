"""Every failure becomes a JSON error in OpenAI's shape; none reaches the engine loop.

`{"error": {"message", "type", "param", "code"}}` is what the `openai` client
parses into its exception classes (and what vLLM returns), so a 400 for an
over-long prompt surfaces as `BadRequestError` with our message.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from asyncgrpo.engine.types import EngineError

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


def error_response(
    message: str, status: int, headers: dict | None = None, param=None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EngineError)
    async def engine_error(request: Request, exc: EngineError):
        return error_response(exc.message, exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(describe_validation_error(exc), 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # Starlette sends this response, then re-raises so the server logs the traceback
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

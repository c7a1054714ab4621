"""The request log's pieces (asyncgrpo.inference.server.request_log): the reason read out
of each server's error bodies, a route's template, and lines that stay one line."""

import json
import logging

from asyncgrpo.inference.server.request_log import (
    JsonLineFormatter,
    refusal_reason,
    route_template,
    text_line,
)


def test_the_reason_is_read_from_each_error_shape():
    tinker = {"error": "model_id: unknown model 'x'", "category": "user"}
    openai = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    assert refusal_reason(json.dumps(tinker).encode()) == tinker["error"]
    assert refusal_reason(json.dumps(openai).encode()) == "prompt too long"
    assert refusal_reason(b'{"detail": "missing or wrong API key"}') == "missing or wrong API key"
    assert refusal_reason(b"request header not complete\n") == "request header not complete"
    assert refusal_reason(b"") == "(no body)"


def test_a_route_template_puts_the_path_parameters_back():
    scope = {
        "route": object(),
        "path": "/api/v1/sessions/session-ab12/finish",
        "path_params": {"session_id": "session-ab12"},
    }
    assert route_template(scope) == "/api/v1/sessions/{session_id}/finish"
    assert route_template({"path": "/nowhere"}) is None  # no route matched


def test_a_line_stays_one_line_and_json_lines_parse():
    fields = {
        "method": "POST",
        "route": "/api/v1/asample",
        "status": 400,
        "latency_ms": 1.5,
        "session": "session-ab12",
        "model": None,
        "refused": 'max_tokens: 9 "too many"\nsee the limits',
    }
    line = text_line(fields)
    assert "\n" not in line and line.startswith(
        "POST /api/v1/asample 400 1.5ms session=session-ab12"
    )
    assert "model=" not in line
    assert 'refused="max_tokens: 9 \\"too many\\"\\nsee the limits"' in line
    record = logging.LogRecord("asyncgrpo.requests", logging.INFO, "", 0, line, (), None)
    record.request = fields
    parsed = json.loads(JsonLineFormatter().format(record))
    assert parsed["refused"] == fields["refused"] and parsed["status"] == 400
    assert parsed["level"] == "info" and parsed["logger"] == "asyncgrpo.requests"


def test_a_client_gone_while_sending_its_body_is_a_499_not_a_500(caplog):
    """A client killed mid-body makes reading the body raise starlette's ClientDisconnect:
    the line and the counters say 499 (nothing was answered), and nothing is raised to
    the server, which would log a traceback and count a 500."""
    import asyncio

    from fastapi import FastAPI, Request

    from asyncgrpo.inference.server.request_log import RequestObserver

    app = FastAPI()

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        return {"size": len(await request.body())}

    counted = []

    class Counts:
        def observe(self, route, method, status, seconds):
            counted.append((route, method, status))

    messages = iter(
        [
            {"type": "http.request", "body": b'{"model_id": ', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/save_weights",
        "raw_path": b"/api/v1/save_weights",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("127.0.0.1", 8100),
        "client": ("127.0.0.1", 50000),
        "root_path": "",
    }
    app.add_middleware(RequestObserver, metrics=Counts())  # as both servers add it
    with caplog.at_level(logging.INFO, logger="asyncgrpo.requests"):
        asyncio.run(app(scope, receive, send))
    assert sent == []  # no one to answer
    assert counted == [("/api/v1/save_weights", "POST", 499)]
    (record,) = [r for r in caplog.records if r.name == "asyncgrpo.requests"]
    assert record.request["status"] == 499
    assert "disconnected" in record.request["refused"]

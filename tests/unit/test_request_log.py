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

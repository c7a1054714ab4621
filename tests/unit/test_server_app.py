"""The server application in-process over a fake engine: auth, limits, weight-update state, errors."""

import logging
import struct
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import TokenDelta
from asyncgrpo.inference.server import ServerSettings, create_app
from asyncgrpo.inference.transport.layout import plan_layout, write_image
from asyncgrpo.testing import build_tiny_tokenizer


class FakeEngine:
    """Just enough of `Engine` for the control routes; records weight updates."""

    model_name = "/models/fake"
    max_model_len = 64
    vocab_size = 100
    dtype = torch.bfloat16
    tokenizer = None

    config = EmbeddedEngineConfig(model="/models/fake", max_num_seqs=4, max_model_len=64)

    def __init__(self):
        self.alive = False
        self.weight_version = 0
        self.updates = []
        self.is_paused = False
        self.fail_pause = False

    def start(self):
        self.alive = True

    def shutdown(self):
        self.alive = False

    def is_alive(self):
        return self.alive

    check_request = Engine.check_request  # the real request checks, on the fake's limits

    def stats(self):
        return {"running": 0, "busy_seconds": 1.5}

    async def pause(self, mode):
        if self.fail_pause:
            raise RuntimeError("pause machinery broke")
        self.is_paused = True

    async def resume(self):
        self.is_paused = False

    def abort_all(self):
        return 0

    async def update_weights(self, named_tensors, version=None):
        self.updates.append(({n: t.clone() for n, t in named_tensors}, version))
        self.weight_version = version


AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture
def engine():
    return FakeEngine()


def make_client(engine, **settings):
    # as under uvicorn: the error response is sent, the exception is only logged
    return TestClient(create_app(engine, ServerSettings(**settings)), raise_server_exceptions=False)


def test_control_routes_are_refused_without_a_configured_token(engine):
    with make_client(engine) as client:
        assert client.get("/health").json() == {"status": "ok"}
        for method, path in [("post", "/pause"), ("get", "/server_info"), ("post", "/resume")]:
            r = getattr(client, method)(path, headers=AUTH)
            assert r.status_code == 403 and "admin-token" in r.json()["error"]["message"]


def test_token_is_required_and_server_info_has_stats(engine):
    with make_client(engine, admin_token="s3cret", served_model_name="fake") as client:
        assert client.get("/server_info").status_code == 401
        assert (
            client.get("/server_info", headers={"Authorization": "Bearer s3cre"}).status_code == 401
        )
        info = client.get("/server_info", headers=AUTH).json()
        assert info["stats"]["busy_seconds"] == 1.5 and info["dtype"] == "bfloat16"
        assert info["vllm_config"]["model_config"]["dtype"] == "torch.bfloat16"
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        assert client.post("/pause?mode=sideways", headers=AUTH).status_code == 422


def test_engine_failures_become_json_errors_and_the_next_request_works(engine):
    with make_client(engine, admin_token="s3cret") as client:
        engine.fail_pause = True
        r = client.post("/pause?mode=keep", headers=AUTH)
        assert r.status_code == 500 and "pause machinery broke" in r.json()["error"]["message"]
        engine.fail_pause = False
        assert client.post("/pause?mode=keep", headers=AUTH).status_code == 200
        assert client.get("/is_paused", headers=AUTH).json() == {"is_paused": True}
        engine.alive = False
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_body_limits_apply_to_declared_and_chunked_bodies(engine):
    with make_client(engine, admin_token="s3cret", max_body_bytes=1000) as client:
        big = b'{"prompt": "' + b"x" * 2000 + b'"}'
        declared = client.post(
            "/v1/completions", content=big, headers={"Content-Type": "application/json"}
        )
        assert declared.status_code == 413
        chunked = client.post(
            "/v1/completions",
            content=iter([big[:700], big[700:]]),
            headers={"Content-Type": "application/json"},
        )
        assert chunked.status_code == 413
        small_chunked = client.post(
            "/v1/completions",
            content=iter([b'{"prompt": [1, 2],', b' "max_tokens": "x"}']),
            headers={"Content-Type": "application/json"},
        )
        assert small_chunked.status_code == 422  # body replayed intact to the route


def safetensors_bytes(tensors):
    layout = plan_layout(tensors)
    buffer = bytearray(layout.total_size)
    write_image(buffer, layout, tensors)
    return bytes(buffer)


def test_weight_update_steps_must_come_in_order(engine):
    with make_client(engine, admin_token="s3cret") as client:
        post = lambda path, **kw: client.post(path, headers={**AUTH, **kw.pop("headers", {})}, **kw)  # noqa: E731
        assert post("/start_weight_update").status_code == 409
        assert (
            post(
                "/init_weight_transfer_engine", json={"init_info": {"backend": "http"}}
            ).status_code
            == 200
        )
        assert post("/update_weights", json={"update_info": {"path": "/x"}}).status_code == 409
        assert post("/finish_weight_update", json={"weight_version": 1}).status_code == 409
        assert post("/start_weight_update").status_code == 200
        r = post("/finish_weight_update", json={"weight_version": 1})
        assert r.status_code == 400 and "no tensors" in r.json()["error"]["message"]
        assert engine.updates == []


def test_http_backend_stages_bytes_and_applies_them_with_the_version(engine):
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    octet = {**AUTH, "Content-Type": "application/octet-stream"}
    with make_client(engine, admin_token="s3cret", max_body_bytes=100) as client:
        client.post(
            "/init_weight_transfer_engine", headers=AUTH, json={"init_info": {"backend": "http"}}
        )
        client.post("/start_weight_update", headers=AUTH)
        # the weight route has its own (larger) limit than the 100-byte default
        r1 = client.post("/update_weights", headers=octet, content=safetensors_bytes([("w", w)]))
        r2 = client.post("/update_weights", headers=octet, content=safetensors_bytes([("b", b)]))
        assert r1.json()["tensors"] == 1 and r2.json()["tensors"] == 1
        assert engine.updates == []  # nothing is applied before finish
        done = client.post("/finish_weight_update", headers=AUTH, json={"weight_version": 7})
        assert done.json()["weight_version"] == 7
        corrupt = struct.pack("<Q", 10**9) + b"{}"
        client.post("/start_weight_update", headers=AUTH)
        bad = client.post("/update_weights", headers=octet, content=corrupt)
        assert bad.status_code == 400 and "header length" in bad.json()["error"]["message"]
    ((received, version),) = engine.updates
    assert version == 7 and torch.equal(received["w"], w) and torch.equal(received["b"], b)


class TokenizingEngine(FakeEngine):
    """The fake with a real tokenizer and a `generate` that answers one token per sample."""

    max_model_len = 512

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    async def generate(self, prompt_ids, params, request_id=None):
        for index in range(params.n):
            yield TokenDelta(index, [5], [-0.5], [0], finish_reason="length")


def test_chat_templates_render_off_the_event_loop():
    """While a template renders, /health answers: the render runs on a worker thread."""
    tokenizer = build_tiny_tokenizer()
    gate, seen = threading.Event(), {}
    render = tokenizer.apply_chat_template

    def slow_render(*args, **kwargs):
        seen["thread"] = threading.current_thread().name
        seen["released"] = gate.wait(timeout=5)  # False if /health could not answer meanwhile
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = slow_render
    engine = TokenizingEngine(tokenizer)
    with make_client(engine) as client:
        answers = {}
        chat = threading.Thread(
            target=lambda: answers.setdefault(
                "chat",
                client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                ),
            )
        )
        chat.start()
        deadline = time.monotonic() + 10
        while "thread" not in seen:
            assert time.monotonic() < deadline, "the template was never rendered"
            time.sleep(0.01)
        assert client.get("/health").status_code == 200
        gate.set()
        chat.join(10)
    assert seen["released"] and seen["thread"].startswith("asyncgrpo-prompts")
    assert answers["chat"].status_code == 200


def test_every_request_is_logged_once_with_the_reason_of_a_refusal(engine, caplog):
    from asyncgrpo.inference.server.request_log import REQUEST_LOGGER

    with caplog.at_level(logging.INFO, logger=REQUEST_LOGGER):
        with make_client(engine, admin_token="s3cret", max_body_bytes=1000) as client:
            client.get("/server_info")
            client.post("/v1/completions", content=b"x" * 2000)
            client.get("/v1/models/whatever/nowhere")
            client.get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOGGER]
    assert len(lines) == 4
    assert lines[0].startswith("GET /server_info 401 ")
    assert 'refused="missing or wrong admin token"' in lines[0]
    assert lines[1].startswith("POST /v1/completions 413 ") and "refused=" in lines[1]
    assert lines[2].startswith("GET /v1/models/whatever/nowhere 404 ")
    assert lines[3].startswith("GET /health 200 ") and "refused" not in lines[3]
    fields = caplog.records[-1].request
    assert fields["status"] == 200 and fields["latency_ms"] >= 0


def test_metrics_need_no_token_parse_and_count_requests_by_route(engine):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(client):
        text = client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    with make_client(engine, admin_token="s3cret") as client, make_client(FakeEngine()) as other:
        before = scrape(client)
        for _ in range(3):
            client.get("/server_info", headers=AUTH)
        client.get("/server_info")
        after = scrape(client)
        apart = scrape(other)  # a second application in this process counts on its own

    def count(samples, status):
        key = (("method", "GET"), ("route", "/server_info"), ("status", status))
        return samples.get(("asyncgrpo_http_requests_total", key), 0.0)

    assert count(after, "200") - count(before, "200") == 3
    assert count(after, "401") - count(before, "401") == 1
    assert count(apart, "200") == 0
    seconds = ("asyncgrpo_http_request_duration_seconds_count", (("route", "/server_info"),))
    assert after[seconds] == 4
    assert after[("asyncgrpo_engine_busy_seconds_total", ())] == 1.5  # the engine's stats()
    assert after[("asyncgrpo_engine_running_requests", ())] == 0

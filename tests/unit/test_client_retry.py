"""The engine client's retry rules against a dead port and a real stub HTTP server."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.client import EngineClient, EngineRefused, EngineUnavailable, RetryPolicy


class StubHandler(BaseHTTPRequestHandler):
    """/fail -> 500, /bad -> 400 with an OpenAI-style error, /flaky -> 503 twice then 200."""

    hits: dict = {}

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        hits = self.server.hits
        hits[self.path] = hits.get(self.path, 0) + 1
        if self.path.startswith("/v1/fail"):
            self._answer(500, {"error": {"message": "engine exploded", "code": 500}})
        elif self.path.startswith("/v1/bad"):
            self._answer(400, {"error": {"message": "prompt has 9 tokens but max_model_len is 4"}})
        elif hits[self.path] <= 2:
            self._answer(503, {"detail": "warming up"})
        else:
            choice = {
                "index": 0,
                "text": "ok",
                "token_ids": [1, 2],
                "logprobs": {"token_logprobs": [-0.5, -0.25]},
                "finish_reason": "length",
                "prompt_token_ids": [9],
            }
            self._answer(200, {"id": "x", "choices": [choice]})

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stub():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    httpd.hits = {}
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


async def call(client):
    return await client.complete([9], max_tokens=2)


def test_dead_port_gives_up_at_the_deadline():
    policy = RetryPolicy(deadline=0.8, max_attempts=1000, base_backoff=0.05, max_backoff=0.2)

    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{free_port()}", retry=policy) as client:
            start = time.monotonic()
            with pytest.raises(EngineUnavailable) as info:
                await call(client)
            return time.monotonic() - start, info.value

    elapsed, error = asyncio.run(scenario())
    assert 0.7 <= elapsed < 3.0
    assert error.attempts > 2 and "ConnectError" in str(error)


def test_5xx_is_retried_up_to_max_attempts_then_reported(stub):
    policy = RetryPolicy(deadline=30, max_attempts=4, base_backoff=0.01, max_backoff=0.02)

    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{stub.server_address[1]}", retry=policy) as c:
            c.base_url = c.base_url + "/"  # trailing slash is tolerated
            response = None
            with pytest.raises(EngineUnavailable) as info:
                response = await c.request("POST", "/v1/fail", json={})
            return response, info.value

    response, error = asyncio.run(scenario())
    assert response is None
    assert stub.hits["/v1/fail"] == 4 and error.attempts == 4 and error.status == 500
    assert "engine exploded" in str(error)


def test_transient_5xx_then_success(stub):
    policy = RetryPolicy(deadline=30, max_attempts=5, base_backoff=0.01, max_backoff=0.02)

    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{stub.server_address[1]}", retry=policy) as c:
            return await c.complete([9], max_tokens=2)

    completion = asyncio.run(scenario())
    assert stub.hits["/v1/completions"] == 3
    sample = completion.samples[0]
    assert sample.token_ids == [1, 2] and sample.logprobs == [-0.5, -0.25]
    assert sample.weight_versions == [-1, -1]  # a server without versions (e.g. vLLM)
    assert completion.prompt_token_ids == [9]


def test_4xx_raises_at_once_with_the_server_message(stub):
    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{stub.server_address[1]}") as c:
            with pytest.raises(EngineRefused) as info:
                await c.request("POST", "/v1/bad", json={})
            return info.value

    error = asyncio.run(scenario())
    assert stub.hits["/v1/bad"] == 1
    assert error.status == 400 and "max_model_len is 4" in str(error)


def test_wait_until_healthy_times_out():
    async def scenario():
        async with EngineClient(f"http://127.0.0.1:{free_port()}") as client:
            with pytest.raises(EngineUnavailable, match="not healthy"):
                await client.wait_until_healthy(timeout=0.5, poll=0.05)

    asyncio.run(scenario())

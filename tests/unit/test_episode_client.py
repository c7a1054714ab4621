"""`LLM.client()`, the OpenAI client a rollout opens per episode: cheap to build (no CA bundle
loaded per client: the process shares one TLS context), and still the SDK's client, with the
episode's deadline and retries, talking to a real HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import json
import ssl
import threading

import httpx
import pytest

from asyncgrpo.learning.agents.rollout_api import LLM, tls_context

COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
    ],
}


@pytest.fixture
def server():
    """A chat-completions endpoint on loopback answering every POST with `COMPLETION`."""
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(
                {"path": self.path, "auth": self.headers["Authorization"], **json.loads(body)}
            )
            reply = json.dumps(COMPLETION).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", seen
    httpd.shutdown()
    httpd.server_close()


def test_clients_share_one_tls_context_and_load_no_ca_bundle_each(monkeypatch):
    tls_context()  # the process's, built once
    loads = []
    original = ssl.SSLContext.load_verify_locations

    def counted(self, *args, **kwargs):
        loads.append(args or kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted)
    clients = [LLM(f"http://127.0.0.1:{9000 + i}/v1", "k", "m").client() for i in range(3)]
    assert loads == []
    assert all(c.base_url.port == 9000 + i for i, c in enumerate(clients))
    httpx.AsyncClient()  # what the SDK's default client does, once per client
    assert len(loads) == 1
    for client in clients:
        asyncio.run(client.close())


def test_the_client_keeps_the_episodes_deadline_retries_and_endpoint(server):
    url, seen = server
    llm = LLM(url, "episode-key", "m", call_timeout_s=7.0, max_retries=4)

    async def chat():
        async with llm.client() as oai:
            assert oai.timeout == 7.0 and oai.max_retries == 4
            reply = await oai.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=3
            )
        return oai, reply

    oai, reply = asyncio.run(chat())
    assert reply.choices[0].message.content == "hi"
    assert oai.is_closed()  # closing the SDK's client closed its HTTP client too
    assert seen == [
        {
            "path": "/v1/chat/completions",
            "auth": "Bearer episode-key",
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
        }
    ]


def test_a_rollouts_own_http_client_is_kept():
    own = httpx.AsyncClient(verify=False)
    oai = LLM("http://127.0.0.1:9/v1", "k", "m").client(http_client=own)
    assert oai._client is own
    asyncio.run(oai.close())
    assert own.is_closed

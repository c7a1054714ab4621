"""Hostile request bodies: each is refused at the protocol layer with a 400 that names the
field and the limit, before anything big is allocated or run on the event loop, and the
server goes on serving everyone else.

One `asyncgrpo serve` child process on the tiny model (max_model_len 512) serves the
module; the keep-alive test runs the app in-process under uvicorn to inject a fault.
"""

import http.client
import json
import logging
import threading
import time

import httpx
import pytest
import uvicorn

from asyncgrpo.inference.server import ServerSettings, create_app

ENGINE_SETTINGS = dict(max_num_seqs=64, max_request_sequences=256)  # conftest's `server`
MAX_MODEL_LEN = 512  # the tiny model's own limit
JSON = {"Content-Type": "application/json"}
HI = [{"role": "user", "content": "Hi"}]


def post(server, path: str, body: dict | bytes, timeout: float = 30.0, **kw) -> httpx.Response:
    """POST a body as written: `json.dumps` keeps NaN, Infinity and lone surrogates."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.base_url}{path}", content=content, headers=JSON, timeout=timeout, **kw
    )


def refused(response: httpx.Response, param: str | None, *words: str) -> str:
    """Assert a 400 whose message has every word and whose `param` names the field."""
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def rss_mb(server) -> float:
    with open(f"/proc/{server._proc.pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def still_serves(server) -> None:
    """A plain greedy request still gets a normal answer."""
    r = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_huge_n_is_refused_before_anything_is_allocated(server):
    before = rss_mb(server)
    started = time.monotonic()
    one = post(server, "/v1/completions", {"prompt": [1], "n": 321589181})
    chat = post(server, "/v1/chat/completions", {"messages": HI, "n": 2_000_000})
    assert time.monotonic() - started < 10  # seconds, not minutes (and no OOM kill)
    assert rss_mb(server) - before < 100
    refused(one, "n", "n=321589181", "max_num_seqs=64")
    refused(chat, "n", "max_num_seqs=64")
    still_serves(server)


def test_sequences_are_bounded_per_request_not_only_per_prompt(server):
    r = post(server, "/v1/completions", {"prompt": [[1, 2]] * 2000, "n": 64, "max_tokens": 1})
    refused(r, "n", "128000", "max_request_sequences=256")
    texts = ["Hello there"] * 300  # refused before any of them is tokenized
    refused(post(server, "/v1/completions", {"prompt": texts}), "n", "300", "256")
    ok = post(server, "/v1/completions", {"prompt": [[1, 2]] * 4, "n": 64, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 256


def test_client_chat_templates_are_refused(server):
    looping = "{% for a in range(10**6) %}{% for b in range(10**6) %}x{% endfor %}{% endfor %}"
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": {"chat_template": looping}},
        timeout=10,
    )
    refused(r, "chat_template_kwargs", "chat_template", "model's own chat template")
    r = post(server, "/v1/chat/completions", {"messages": HI, "chat_template": looping})
    refused(r, "chat_template", "model's own chat template")
    nested = {"messages": HI, "chat_template_kwargs": {"extra": {"deep": [1, 2]}}}
    refused(post(server, "/v1/chat/completions", nested), "chat_template_kwargs", "extra")
    big = {"messages": HI, "chat_template_kwargs": {"note": "x" * 5000}}
    refused(post(server, "/v1/chat/completions", big), "chat_template_kwargs", "1024")
    fine = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(server, "/v1/chat/completions", fine).status_code == 200
    # the episode gateway shares the chat checks
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    episode = httpx.post(f"{server.base_url}/episodes", headers=admin).json()
    r = httpx.post(
        f"{server.base_url}{episode['base_path']}/chat/completions",
        headers={"Authorization": f"Bearer {episode['api_key']}"},
        json={"messages": HI, "chat_template_kwargs": {"chat_template": looping}},
        timeout=10,
    )
    refused(r, "chat_template_kwargs", "chat_template")


def test_oversized_prompt_is_refused_while_health_keeps_answering(server):
    text = "hello world " * 1_300_000  # 15.6 MB, under the 16 MiB body limit
    results = {}

    def send(path, body):
        results[path] = post(server, path, body, timeout=120)

    senders = [
        threading.Thread(target=send, args=("/v1/completions", {"prompt": text})),
        threading.Thread(
            target=send,
            args=("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ),
    ]
    before = rss_mb(server)
    for sender in senders:
        sender.start()
    while any(s.is_alive() for s in senders):
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        time.sleep(0.05)
    refused(results["/v1/completions"], "prompt", f"max_model_len is {MAX_MODEL_LEN}")
    refused(results["/v1/chat/completions"], "messages", f"max_model_len is {MAX_MODEL_LEN}")
    assert rss_mb(server) - before < 400  # the bodies themselves, not a tokenization
    # short enough for the cheap bound, too long once tokenized (off the loop)
    r = post(server, "/v1/completions", {"prompt": "hello world " * 200, "max_tokens": 1})
    refused(r, None, f"max_model_len is {MAX_MODEL_LEN}")
    still_serves(server)


def test_stop_strings_and_stop_token_ids_are_bounded(server):
    base = {"prompt": [1, 2], "n": 16, "max_tokens": 4}
    million = json.dumps({**base, "stop": [f"s{i}" for i in range(1_000_000)]}).encode()
    refused(post(server, "/v1/completions", million), "stop", "at most 16 stop strings")
    refused(post(server, "/v1/completions", {**base, "stop": ["x" * 257]}), "stop", "256")
    many_ids = {**base, "stop_token_ids": list(range(65))}
    refused(post(server, "/v1/completions", many_ids), "stop_token_ids", "at most 64")
    outside = {**base, "stop_token_ids": [10**9]}
    refused(post(server, "/v1/completions", outside), "stop_token_ids", "[0, ")
    ok = {**base, "stop": [f"s{i}" for i in range(16)], "stop_token_ids": list(range(64))}
    assert post(server, "/v1/completions", ok).status_code == 200


def test_impossible_lengths_are_refused(server):
    for path, body, field in [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ]:
        refused(post(server, path, body, timeout=10), field, field, ">= 1")
    over = {"prompt": [5] * 500, "max_tokens": 100}
    message = refused(post(server, "/v1/completions", over), "max_tokens", "600 tokens")
    assert f"maximum context length is {MAX_MODEL_LEN}" in message and "max_model_len" in message
    huge = {"messages": HI, "max_tokens": 10**12}
    refused(post(server, "/v1/chat/completions", huge), "max_tokens", "max_model_len")
    # omitted: completions default to 16 (cut to fit), chat to the rest of the context
    near_full = post(server, "/v1/completions", {"prompt": [5] * 510, "ignore_eos": True})
    assert near_full.status_code == 200
    assert near_full.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 510


BAD_VALUES = [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -0.5),
    ("temperature", 1e6),
    ("top_p", float("nan")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 2**63),
    ("top_k", -2),
    ("seed", 2**64),
    ("seed", -1),
    ("n", 0),
    ("logprobs", 21),
    ("logprobs", -1),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_sampling_values_out_of_range_are_refused_naming_the_field(server, field, value):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, field: value}
    refused(post(server, "/v1/completions", body, timeout=10), field, field)


def test_chat_sampling_values_out_of_range_are_refused(server):
    for field, value in [("top_logprobs", 21), ("temperature", float("nan")), ("seed", 2**64)]:
        body = {"messages": HI, "max_tokens": 2, "logprobs": True, field: value}
        refused(post(server, "/v1/chat/completions", body, timeout=10), field, field)
    still_serves(server)


def test_lone_surrogates_are_a_400_not_a_500(server):
    surrogate = "\ud800"
    refused(post(server, "/v1/completions", {"prompt": surrogate}), "prompt", "surrogate")
    chat = {"messages": [{"role": "user", "content": f"a{surrogate}b"}]}
    refused(post(server, "/v1/chat/completions", chat), "messages", "surrogate")
    stop = {"prompt": [1, 2], "stop": [surrogate], "max_tokens": 2}
    refused(post(server, "/v1/completions", stop), "stop", "surrogate")
    unknown_model = post(server, "/v1/completions", {"prompt": [1], "model": surrogate})
    assert unknown_model.status_code == 404 and "does not exist" in unknown_model.text
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    episode = httpx.post(f"{server.base_url}/episodes", headers=admin).json()
    on_episode = httpx.post(
        f"{server.base_url}{episode['base_path']}/chat/completions",
        headers={"Authorization": f"Bearer {episode['api_key']}"},
        content=json.dumps(chat),
        timeout=10,
    )
    refused(on_episode, "messages", "surrogate")
    still_serves(server)


class FlakyEngine:
    """Just enough of an engine for /health, whose health check can be made to raise."""

    model_name = "flaky"
    broken = False

    def start(self):
        pass

    def shutdown(self):
        pass

    def is_alive(self):
        if self.broken:
            raise RuntimeError("health check exploded")
        return True


@pytest.fixture
def flaky_server():
    engine = FlakyEngine()
    app = create_app(engine, ServerSettings())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield engine, port
    finally:
        server.should_exit = True
        thread.join(10)


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, dict]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_a_500_keeps_the_keep_alive_connection_usable(flaky_server, caplog):
    """http.client, unlike httpx, never reconnects silently: a closed connection fails."""
    engine, port = flaky_server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert get(conn, "/health")[0] == 200
    sock = conn.sock
    engine.broken = True
    with caplog.at_level(logging.ERROR):
        status, body = get(conn, "/health")
    engine.broken = False
    for _ in range(10):
        assert get(conn, "/health") == (200, {"status": "ok"})
    assert conn.sock is sock  # the same connection all along
    conn.close()
    assert status == 500 and "health check exploded" in body["error"]["message"]
    assert body["error"]["type"] == "InternalServerError"
    assert len([r for r in caplog.records if r.exc_info]) == 1  # the traceback, logged once

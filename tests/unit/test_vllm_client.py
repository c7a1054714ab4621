"""`VLLMClient` against a scripted vLLM (httpx.MockTransport): what it sends, what it reads;
and the command line and environment `VLLMServer` starts vLLM with (nothing is started)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from asyncgrpo.base.config import VLLMEngineConfig
from asyncgrpo.base.engine_errors import EngineUnavailable
from asyncgrpo.inference.client import EngineProtocolError
from asyncgrpo.inference.client.retry import RetryPolicy
from asyncgrpo.inference.vllm.client import GENERATE_PATH, VLLMClient, expand_spans, parse_version
from asyncgrpo.inference.vllm.launcher import PLUGIN_DIR, VLLMServer, VLLMServerError


def choice(token_ids, spans, index=0, finish="length", logprob_ids=None):
    content = [
        {"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(logprob_ids or token_ids)
    ]
    return {
        "index": index,
        "token_ids": token_ids,
        "finish_reason": finish,
        "stop_reason": None,
        "weight_versions": spans,
        "logprobs": {"content": content},
    }


class ScriptedVLLM:
    """Records every request; answers from `routes` (path -> response or list of them)."""

    def __init__(self, routes: dict):
        self.routes = routes
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.routes.get(request.url.path, httpx.Response(200, json={}))
        if isinstance(answer, list):
            answer = answer.pop(0)
        return answer

    def bodies(self, path: str) -> list:
        return [json.loads(r.content or b"null") for r in self.requests if r.url.path == path]

    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]


def make_client(server: ScriptedVLLM, **kwargs) -> VLLMClient:
    retry = RetryPolicy(deadline=5, max_attempts=3, base_backoff=0.001)
    client = VLLMClient("http://vllm.test", retry=retry, **kwargs)
    transport = httpx.MockTransport(server)
    client._http = httpx.AsyncClient(transport=transport)
    client._control_http = httpx.AsyncClient(transport=transport)
    return client


def run(coro):
    return asyncio.run(coro)


def test_spans_expand_to_one_version_per_token():
    spans = [{"version": "3", "start": 2, "end": 5}, {"version": "default", "start": 0, "end": 2}]
    assert expand_spans(spans, 5) == [0, 0, 3, 3, 3]
    assert expand_spans([], 0) == [] and expand_spans(None, 0) == []
    assert parse_version("default") == 0 and parse_version("17") == 17


@pytest.mark.parametrize(
    "spans, n",
    [
        ([{"version": "v1", "start": 0, "end": 2}], 2),  # not an integer
        ([{"version": "-1", "start": 0, "end": 2}], 2),
        ([{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}], 3),
        ([{"version": "1", "start": 0, "end": 2}], 3),  # covers too few tokens
        (None, 2),  # a server without --enable-scale-out
    ],
)
def test_bad_spans_are_protocol_errors(spans, n):
    with pytest.raises(EngineProtocolError):
        expand_spans(spans, n)


def test_complete_sends_token_ids_and_vllm_sampling_params():
    server = ScriptedVLLM({})
    server.routes[GENERATE_PATH] = httpx.Response(
        200,
        json={
            "choices": [
                choice([7, 8, 9], [{"version": "default", "start": 0, "end": 3}], index=1),
                choice([4], [{"version": "2", "start": 0, "end": 1}], index=0, finish="stop"),
            ]
        },
    )
    client = make_client(server)
    completion = run(
        client.complete(
            [1, 2, 3], n=2, max_tokens=3, temperature=0.7, top_p=0.9, top_k=-1,
            stop=["\n\n"], stop_token_ids=[5], ignore_eos=True,
        )
    )  # fmt: skip
    (body,) = server.bodies(GENERATE_PATH)
    assert body == {
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "n": 2,
            "max_tokens": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 0,  # vLLM's "off"
            "ignore_eos": True,
            "skip_special_tokens": False,  # stop strings match special tokens, as embedded
            "logprobs": 0,
            "stop": ["\n\n"],
            "stop_token_ids": [5],
        },
    }
    first, second = completion.samples
    assert first.token_ids == [4] and first.weight_versions == [2] and first.finish_reason == "stop"
    assert second.token_ids == [7, 8, 9] and second.weight_versions == [0, 0, 0]
    assert second.logprobs == [-0.5, -1.0, -1.5]
    assert completion.prompt_token_ids == [1, 2, 3]


def test_a_request_names_its_adapter_and_can_score_the_prompt():
    """`use_adapter` (a training run's adapter: its version on every token, its requests
    counted) or an adapter named per request (`model`, tinker-serve's samplers), and vLLM's
    prompt log-probs read as the embedded engine reports them."""
    server = ScriptedVLLM({})
    spans = [{"version": "default", "start": 0, "end": 1}]
    prompt_logprobs = [
        None,
        {"5": {"logprob": -3.0, "rank": 9}, "11": {"logprob": -0.1, "rank": 1}},
        {"6": {"logprob": -0.2, "rank": 1}},
    ]
    server.routes[GENERATE_PATH] = [
        httpx.Response(200, json={"choices": [choice([4], spans)]}),
        httpx.Response(
            200, json={"choices": [choice([4], spans)], "prompt_logprobs": prompt_logprobs}
        ),
    ]
    client = make_client(server)
    client.use_adapter(3)
    trained = run(client.complete([1, 5, 6], max_tokens=1))
    named = run(client.complete([1, 5, 6], max_tokens=1, model="sampler-a", prompt_logprobs=1))
    first, second = server.bodies(GENERATE_PATH)
    assert first["model"] == "asyncgrpo-v3" and "prompt_logprobs" not in first["sampling_params"]
    assert (
        trained.samples[0].weight_versions == [3] and client.adapter_requests["asyncgrpo-v3"] == 0
    )
    assert second["model"] == "sampler-a" and second["sampling_params"]["prompt_logprobs"] == 1
    assert named.samples[0].weight_versions == [0]  # vLLM's label: the adapter is the caller's
    assert named.prompt_logprobs == [None, -3.0, -0.2]
    assert named.prompt_top_logprobs == [None, [(11, -0.1)], [(6, -0.2)]]


def test_logprobs_of_other_tokens_are_a_protocol_error():
    spans = [{"version": "1", "start": 0, "end": 2}]
    answer = {"choices": [choice([7, 8], spans, logprob_ids=[7, 9])]}
    client = make_client(ScriptedVLLM({GENERATE_PATH: httpx.Response(200, json=answer)}))
    with pytest.raises(EngineProtocolError, match="log-probs of other tokens"):
        run(client.complete([1]))


def test_seeds_are_dropped_with_one_warning_unless_the_server_has_a_gpu(caplog):
    answer = {"choices": [choice([7], [{"version": "default", "start": 0, "end": 1}])]}
    server = ScriptedVLLM({GENERATE_PATH: [httpx.Response(200, json=answer) for _ in range(3)]})
    client = make_client(server)
    run(client.complete([1], seed=1))
    run(client.complete([1], seed=2))
    client.send_seed = True
    run(client.complete([1], seed=3))
    seeds = [body["sampling_params"].get("seed") for body in server.bodies(GENERATE_PATH)]
    assert seeds == [None, None, 3]
    assert caplog.text.count("seeds are not sent") == 1


def test_weight_update_in_vllms_dialect():
    server = ScriptedVLLM(
        {
            "/reset_prefix_cache": httpx.Response(200, json={"success": True}),
            "/weight_info": httpx.Response(200, json={"weight_version": "7"}),
        }
    )
    client = make_client(server, weights_dir="/data/weights")

    async def sync(version):
        await client.init_weight_transfer_engine("shm")
        await client.start_weight_update()
        await client.update_weights({"path": "/dev/shm/asyncgrpo-weights-1.safetensors"})
        await client.finish_weight_update(version)

    run(sync(7))
    run(sync(8))
    client.forget_transfer_engine()
    run(sync(9))
    assert (
        server.bodies("/init_weight_transfer_engine")
        == [{"init_info": {"weights_dir": "/data/weights"}}] * 2
    )  # once per server process
    assert server.bodies("/finish_weight_update") == [
        {"weight_version": "7"},
        {"weight_version": "8"},
        {"weight_version": "9"},
    ]
    paths = server.paths()
    assert paths[paths.index("/finish_weight_update") + 1] == "/reset_prefix_cache"
    assert server.bodies("/start_weight_update") == [None] * 3
    assert run(client.weight_version()) == 7


def test_new_requests_are_salted_with_the_version_after_a_sync():
    answer = {"choices": [choice([7], [{"version": "4", "start": 0, "end": 1}])]}
    server = ScriptedVLLM({GENERATE_PATH: [httpx.Response(200, json=answer) for _ in range(2)]})
    client = make_client(server)
    run(client.complete([1]))
    run(client.finish_weight_update(4))
    run(client.complete([1]))
    salts = [body.get("cache_salt") for body in server.bodies(GENERATE_PATH)]
    assert salts == [None, "asyncgrpo-4"]  # vLLM's label, as the gateway salts


def test_generation_is_retried_through_a_dying_server_but_control_calls_are_not():
    answer = {"choices": [choice([7], [{"version": "default", "start": 0, "end": 1}])]}
    dying = httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue"}})
    server = ScriptedVLLM(
        {
            GENERATE_PATH: [dying, httpx.Response(200, json=answer)],
            "/update_weights": [dying, httpx.Response(200, json={})],
        }
    )
    client = make_client(server)
    assert run(client.complete([1])).samples[0].token_ids == [7]
    with pytest.raises(EngineUnavailable, match="EngineCore encountered an issue"):
        run(client.update_weights({"path": "x"}))
    assert server.paths().count("/update_weights") == 1


def test_refused_connections_are_retried_until_the_server_is_back():
    answer = {"choices": [choice([7], [{"version": "default", "start": 0, "end": 1}])]}
    attempts = []

    def flaky(request):
        attempts.append(request)
        if len(attempts) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=answer)

    client = make_client(ScriptedVLLM({}))
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(flaky))
    assert run(client.complete([1])).samples[0].token_ids == [7]
    assert len(attempts) == 3


def test_control_routes_and_info():
    server = ScriptedVLLM(
        {
            "/abort_requests": httpx.Response(200, json={"status": "aborted", "aborted": 2}),
            "/is_paused": httpx.Response(200, json={"is_paused": True}),
            "/weight_info": httpx.Response(200, json={"weight_version": "default"}),
            "/health": [httpx.Response(503), httpx.Response(200)],
        }
    )
    client = make_client(server)
    assert run(client.abort_requests()) == 2
    assert server.bodies("/abort_requests") == [{}]  # vLLM needs a JSON object
    run(client.pause("keep"))
    assert server.requests[-1].url.params["mode"] == "keep"
    assert run(client.server_info()) == {"weight_version": 0, "is_paused": True}
    assert run(client.engine_dead()) and not run(client.engine_dead())


# ---- the launcher's command line -----------------------------------------------------


def test_server_command_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    cfg = VLLMEngineConfig(
        model=str(tmp_path),
        vllm_python="/bin/sh",  # any executable: nothing is started
        dtype="bfloat16",
        max_model_len=512,
        served_model_name="policy",
        vllm_args=["--enforce-eager"],
    )
    server = VLLMServer(cfg)
    command = server.command()
    assert command[:3] == ["/bin/sh", "-m", "vllm.entrypoints.openai.api_server"]

    def option(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert option("--served-model-name") == "policy" and option("--host") == "127.0.0.1"
    assert option("--port") == str(server.port) and option("--dtype") == "bfloat16"
    assert option("--logprobs-mode") == "processed_logprobs" and option("--max-model-len") == "512"
    assert json.loads(option("--weight-transfer-config")) == {"backend": "asyncgrpo_file"}
    assert option("--worker-extension-cls").startswith("asyncgrpo_vllm_worker.")
    assert "--enable-scale-out" in command and command[-1] == "--enforce-eager"
    env = server.env()
    assert env["PYTHONPATH"] == f"{PLUGIN_DIR}:/elsewhere" and env["VLLM_SERVER_DEV_MODE"] == "1"
    nccl = VLLMServer(cfg.model_copy(update={"weight_transport": "nccl"})).command()
    assert json.loads(nccl[nccl.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}


def test_a_missing_vllm_environment_is_a_clear_error(tmp_path, monkeypatch):
    cfg = VLLMEngineConfig(model=str(tmp_path), vllm_python=str(tmp_path / "python"))
    with pytest.raises(VLLMServerError, match="engine.vllm_python.*make test-vllm"):
        VLLMServer(cfg)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(VLLMServerError, match="engine.vllm_python.*make test-vllm"):
        VLLMServer(cfg.model_copy(update={"vllm_python": None}))


def test_launched_cpu_servers_are_not_pinned_and_share_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(9)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the trainer's own setting (torchrun's)
    cfg = VLLMEngineConfig(model=str(tmp_path), vllm_python="/bin/sh", replicas=2)

    def threads(server: VLLMServer) -> tuple[str, str]:
        env = server.env()
        return env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]

    # 9 cores, one left to the front ends: 8 for one server, 4 each for two, 2 for three
    assert threads(VLLMServer(cfg.model_copy(update={"replicas": 1}), replica=0)) == (
        "nobind",
        "8",
    )
    assert threads(VLLMServer(cfg)) == ("nobind", "8")  # one of several, but not launched here
    assert [threads(VLLMServer(cfg, replica=i)) for i in (0, 1)] == [("nobind", "4")] * 2
    three = cfg.model_copy(update={"replicas": 3})
    assert threads(VLLMServer(three, replica=2)) == ("nobind", "2")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert [threads(VLLMServer(cfg, replica=i)) for i in (0, 1)] == [("nobind", "1")] * 2
    # the user's settings win, from the recipe or the environment
    mine = cfg.model_copy(update={"vllm_env": {"OMP_NUM_THREADS": "3"}})
    assert threads(VLLMServer(mine, replica=1)) == ("nobind", "3")
    pinned = cfg.model_copy(update={"vllm_env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}})
    assert threads(VLLMServer(pinned, replica=1)) == ("0-1", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert VLLMServer(cfg, replica=0).env()["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


# ---- a server that others can reach --------------------------------------------------

EXPOSED = "vLLM's pause and weight-update routes have no authentication"


def test_a_launched_server_on_a_non_loopback_host_is_warned_about(tmp_path, caplog):
    cfg = VLLMEngineConfig(model=str(tmp_path), vllm_python="/bin/sh")
    with caplog.at_level("WARNING", logger="asyncgrpo.inference.vllm.launcher"):
        VLLMServer(cfg)
    assert EXPOSED not in caplog.text
    exposed = cfg.model_copy(update={"vllm_host": "10.1.2.3", "allow_unauthenticated_vllm": True})
    with caplog.at_level("WARNING", logger="asyncgrpo.inference.vllm.launcher"):
        server = VLLMServer(exposed)
    assert server.command()[server.command().index("--host") + 1] == "10.1.2.3"
    assert "engine.vllm_host 10.1.2.3 is not a loopback address" in caplog.text
    assert EXPOSED in caplog.text and "replace its weights" in caplog.text


def test_an_attached_server_on_a_non_loopback_address_is_warned_about(tmp_path, caplog):
    from asyncgrpo.inference.backend.vllm import VLLMBackend

    cfg = VLLMEngineConfig(model=str(tmp_path), base_url="http://127.0.0.1:8000")
    with caplog.at_level("WARNING", logger="asyncgrpo.inference.backend.vllm"):
        run(VLLMBackend(cfg).close())
    assert EXPOSED not in caplog.text
    with caplog.at_level("WARNING", logger="asyncgrpo.inference.backend.vllm"):
        backend = VLLMBackend(cfg.model_copy(update={"base_url": "http://10.1.2.3:8000"}))
        run(backend.close())
    assert backend.server is None  # attached: nothing is launched
    assert "engine.base_url http://10.1.2.3:8000 is not a loopback address" in caplog.text
    assert EXPOSED in caplog.text and "replace its weights" in caplog.text


# ---- a restart whose start-up hangs --------------------------------------------------

# Stands in for `python -m vllm.entrypoints.openai.api_server`: the starts listed in
# HANG (1-based, counted in a file) never answer, the others serve what `wait_ready` asks.
STAND_IN = """#!{python}
import http.server, json, pathlib, sys, time
count = pathlib.Path({count!r})
start = int(count.read_text() or 0) + 1 if count.exists() else 1
count.write_text(str(start))
if start in {hang}:
    time.sleep(600)
class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.answer({{}})
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({{"choices": []}})
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def stand_in_server(tmp_path, hang: set[int]) -> VLLMServer:
    script = tmp_path / "python"
    script.write_text(
        STAND_IN.format(python=sys.executable, count=str(tmp_path / "starts"), hang=hang)
    )
    script.chmod(0o755)
    cfg = VLLMEngineConfig(model=str(tmp_path), vllm_python=str(script))
    return VLLMServer(cfg, log_path=tmp_path / "vllm.log")


def starts(tmp_path) -> int:
    return int((tmp_path / "starts").read_text())


def running(tmp_path) -> list[int]:
    """Pids of stand-ins still running (a stopped start must leave none behind)."""
    script = str(tmp_path / "python").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and script in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.heavy  # waits out a start-up timeout
def test_a_restart_that_hangs_in_start_up_is_stopped_and_tried_once_more(tmp_path, caplog):
    server = stand_in_server(tmp_path, hang={2})
    try:
        server.start()
        server.wait_ready(30)
        with caplog.at_level("WARNING", logger="asyncgrpo.inference.vllm.launcher"):
            server.restart(timeout=3)  # start 2 hangs, start 3 answers
        assert starts(tmp_path) == 3 and server.restarts == 1 and server.alive()
        assert running(tmp_path) == [server.pid]  # the hung start was stopped
        assert "restarting vLLM failed (vLLM did not become healthy" in caplog.text
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    finally:
        server.close()
    assert running(tmp_path) == []


def test_a_restart_that_never_comes_up_fails_and_leaves_nothing_running(tmp_path):
    server = stand_in_server(tmp_path, hang={2, 3})
    try:
        server.start()
        server.wait_ready(30)
        with pytest.raises(VLLMServerError, match="did not become healthy"):
            server.restart(timeout=2)
        assert starts(tmp_path) == 3 and not server.alive() and running(tmp_path) == []
    finally:
        server.close()
    with pytest.raises(VLLMServerError, match="closed for good"):
        server.start()  # as a replica's restart after the run's close

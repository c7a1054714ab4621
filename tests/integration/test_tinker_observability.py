"""What `asyncgrpo tinker-serve` tells its operator, driven by the real `tinker` SDK (0.38):
one log line per request, naming the reason of every refusal the client got, and
`GET /metrics` in Prometheus's format, whose counters move as requests are made."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker_server import API_KEY, datum, running_tinker

from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.server.request_log import REQUEST_LOGGER, JsonLineFormatter

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types


class JsonLines(logging.Handler):
    """The request log as the JSON lines `--log-format json` writes, parsed back."""

    def __init__(self):
        super().__init__()
        self.setFormatter(JsonLineFormatter())
        self.lines: list[dict] = []

    def emit(self, record):
        self.lines.append(json.loads(self.format(record)))

    def matching(self, **fields) -> list[dict]:
        return [x for x in self.lines if all(x.get(k) == v for k, v in fields.items())]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    os.environ["TINKER_TELEMETRY"] = "0"
    log = logging.getLogger(REQUEST_LOGGER)
    handler, level = JsonLines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with running_tinker(tiny_model_dir, tmp_path_factory.mktemp("state")) as (url, svc):
            with tinker.ServiceClient(base_url=url, api_key=API_KEY) as client:
                yield url, svc, client, handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `GET /metrics` (no key sent) by (name, sorted labels)."""
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def requests_of(samples, route: str, status: int) -> float:
    labels = (("method", "POST"), ("route", route), ("status", str(status)))
    return samples.get(("asyncgrpo_http_requests_total", labels), 0.0)


def test_refused_requests_are_logged_with_the_reason_the_client_got(served, tiny_model_dir):
    url, service, client, log = served
    trainer = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    session = trainer.model_id.split(":")[0]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    too_long = types.SamplingParams(max_tokens=service.served.max_length + 10, stop=[])
    with pytest.raises(tinker.BadRequestError) as refused:
        sampler.sample(prompt, 1, too_long).result(timeout=60)
    good = datum(list(range(5, 15)), weights=np.ones(9))
    with pytest.raises(tinker.RequestFailedError):  # fails through its future, in turn
        trainer.forward_backward([good], "no_such_loss").result(timeout=60)
    trainer.forward_backward([good], "cross_entropy").result(timeout=60)
    assert httpx.post(f"{url}/api/v1/create_session", json={}).status_code == 401
    time.sleep(0.2)  # the last line is written once its response has gone

    [sample_line] = log.matching(route="/api/v1/asample", status=400)
    assert "max_tokens" in sample_line["refused"] and "context" in sample_line["refused"]
    assert sample_line["refused"] in str(refused.value)  # what the client was told
    assert sample_line["session"] == session and sample_line["model"].startswith(session)
    [loss_line] = [x for x in log.matching(route="/api/v1/retrieve_future") if "refused" in x]
    assert "loss_fn" in loss_line["refused"] and loss_line["session"] == session
    [key_line] = log.matching(route="/api/v1/create_session", status=401)
    assert "API key" in key_line["refused"]
    trained = log.matching(route="/api/v1/forward_backward", status=200, model=trainer.model_id)
    assert len(trained) == 2 and all(x["session"] == session for x in trained)
    assert all(x["latency_ms"] >= 0 and x["level"] == "info" for x in log.lines)
    assert not any("refused" in x for x in log.matching(status=200, route="/api/v1/optim_step"))


def test_metrics_parse_and_move_with_requests(served, tiny_model_dir):
    url, service, client, _ = served
    before = scrape(url)
    trainer = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    sft = datum(list(range(20, 32)), weights=np.ones(11))
    for _ in range(2):
        trainer.forward_backward([sft], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, seed=1, stop=[])
    sampler.sample(types.ModelInput.from_ints([20, 21]), 3, params).result()
    after = scrape(url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert (
        requests_of(after, "/api/v1/forward_backward", 200)
        - requests_of(before, "/api/v1/forward_backward", 200)
        >= 2
    )
    assert moved("asyncgrpo_tinker_operation_seconds_count", operation="forward_backward") == 2
    assert moved("asyncgrpo_tinker_operation_seconds_count", operation="optim_step") == 2
    assert moved("asyncgrpo_tinker_operation_seconds_count", operation="sample") == 1
    assert moved("asyncgrpo_tinker_sampled_tokens_total") == 3 * 5
    duration = ("asyncgrpo_http_request_duration_seconds_count", (("route", "/api/v1/optim_step"),))
    assert after[duration] - before.get(duration, 0.0) >= 2
    assert after[("asyncgrpo_tinker_resident_models", ())] == service.resident_models() >= 1
    assert after[("asyncgrpo_tinker_futures_pending", ())] == 0
    depth = ("asyncgrpo_tinker_model_queue_depth", (("model", trainer.model_id),))
    assert after[depth] == 0
    assert after[("asyncgrpo_tinker_sessions_live", ())] >= 1


def test_two_applications_on_one_process_keep_their_registries_apart(served):
    from asyncgrpo.tinker.app import create_app

    _, service, _, _ = served
    first, second = (create_app(service, API_KEY) for _ in range(2))  # no duplicate series
    assert first.state is not second.state


@pytest.mark.heavy  # its own tinker-serve process and engine: ~15 s
def test_the_command_line_logs_json_lines_and_serves_metrics(tiny_model_dir, tmp_path):
    """`asyncgrpo tinker-serve --log-format json` as a user starts it: every line on
    stderr parses, the refused one says why."""
    port = free_port()
    command = [sys.executable, "-m", "asyncgrpo.cli", "tinker-serve", "--model"]
    command += [str(tiny_model_dir), "--port", str(port), "--log-format", "json"]
    command += ["--state-dir", str(tmp_path / "state"), "--dtype", "float32"]
    env = dict(os.environ, ASYNCGRPO_TINKER_API_KEY=API_KEY)
    stderr = tmp_path / "stderr.log"
    with open(stderr, "w") as err:
        server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.post(f"{url}/api/v1/get_info", json={}).status_code == 401
        assert "asyncgrpo_http_requests_total" in httpx.get(f"{url}/metrics").text
    finally:
        server.terminate()
        server.wait(30)
    lines = [json.loads(x) for x in stderr.read_text().splitlines() if x.startswith("{")]
    refused = [x for x in lines if x.get("route") == "/api/v1/get_info"]
    assert [x["status"] for x in refused] == [401] and "API key" in refused[0]["refused"]
    assert any(x.get("route") == "/metrics" and x["status"] == 200 for x in lines)

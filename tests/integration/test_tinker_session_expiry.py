"""Sessions of `asyncgrpo tinker-serve` end, driven by the real `tinker` SDK (0.38).

The server runs with a 3 s session TTL. A client process that goes silent (frozen with
SIGSTOP, as a suspended laptop or a hung host would be) loses its session: its pending
operation fails with "session ... expired" when it wakes, its next request is refused the
same way, its model leaves the server's memory, and what it saved loads, bit-identical, in
a later session. Heartbeats alone keep an idle session alive; `ServiceClient.close` ends
one at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from tinker_server import API_KEY, datum, running_tinker

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types
TTL_S = 3.0  # long enough for a loaded machine to answer a client in time

# A user's program: it trains, saves, samples, reports, then waits for the word to submit
# one more operation, which it waits on; then it tries another, and exits without goodbye.
CLIENT = """
import json, os, sys
import numpy as np
import tinker
from tinker import types

url, key, base = sys.argv[1:4]
tokens = list(range(40, 60))
sft = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
    },
)
client = tinker.ServiceClient(base_url=url, api_key=key)
trainer = client.create_lora_training_client(base_model=base, rank=4, seed=11).result()
trainer.forward_backward([sft], "cross_entropy").result()
trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
state = trainer.save_state("before-exit").result().path
weights = trainer.save_weights_for_sampler("before-exit").result().path
sampler = trainer.create_sampling_client(weights).result()
params = types.SamplingParams(max_tokens=6, seed=5, stop=[])
seq = sampler.sample(types.ModelInput.from_ints([40, 41, 42]), 1, params).result().sequences[0]
out = trainer.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
report = {"model_id": trainer.model_id, "state": state, "weights": weights,
          "logprobs": out.to_numpy().tolist(), "tokens": list(seq.tokens),
          "sample_logprobs": list(seq.logprobs)}
print(json.dumps(report), flush=True)
sys.stdin.readline()
pending = trainer.forward_backward([sft], "cross_entropy")
print(json.dumps({"submitted": True}), flush=True)
try:
    pending.result(timeout=120)
    print(json.dumps({"pending": "succeeded"}), flush=True)
except tinker.RequestFailedError as exc:
    print(json.dumps({"pending": str(exc), "category": exc.category.value}), flush=True)
try:
    trainer.forward([sft], "cross_entropy").result(timeout=60)
    print(json.dumps({"after": "succeeded"}), flush=True)
except Exception as exc:
    print(json.dumps({"after": f"{type(exc).__name__}: {exc}"}), flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    os.environ["TINKER_TELEMETRY"] = "0"
    state_dir = tmp_path_factory.mktemp("tinker-state")
    with running_tinker(tiny_model_dir, state_dir, session_ttl_s=TTL_S) as (url, service):
        yield url, service


def wait_for(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` held (polled every 20 ms); fails after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def line_reader(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in stream], daemon=True).start()
    return lines


def next_json(lines: queue.Queue, timeout: float = 120) -> dict:
    while True:
        line = lines.get(timeout=timeout)
        if line.startswith("{"):
            return json.loads(line)


def test_a_frozen_clients_session_expires_and_what_it_saved_loads_later(served, tiny_model_dir):
    url, service = served
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, url, API_KEY, str(tiny_model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    release = threading.Event()
    try:
        lines = line_reader(client.stdout)
        report = next_json(lines)
        model_id = report["model_id"]
        session_id = model_id.split(":")[0]
        trainer = weakref.ref(service.models.models[model_id].trainer)
        assert session_id in service.sessions.live
        # the trainer's one thread is kept busy, so the next operation stays pending
        blocker = service._trainer.submit(release.wait, 60)
        client.stdin.write("go\n")
        client.stdin.flush()
        assert next_json(lines) == {"submitted": True}
        wait_for(lambda: service.futures.pending_owned(session_id) == 1, 30, "submitted")
        os.kill(client.pid, signal.SIGSTOP)
        silent_s = wait_for(lambda: service.sessions.is_ended(session_id), 30, "expired")
        assert silent_s >= TTL_S / 2 - 0.1  # its last poll came at most TTL/2 before
        assert service.futures.pending_owned(session_id) == 0
        release.set()
        blocker.result(10)
        wait_for(lambda: model_id not in service.models.models, 10, "model released")
        os.kill(client.pid, signal.SIGCONT)
        pending, after = next_json(lines), next_json(lines)
        assert client.wait(60) == 0
    finally:
        release.set()
        client.kill()
        client.wait()
    assert "expired" in pending["pending"] and "--session-ttl" in pending["pending"]
    assert pending["category"] == "user"
    assert after["after"].startswith("BadRequestError") and "expired" in after["after"]
    assert service.sessions.how_ended(session_id) == "expired"
    gc.collect()
    assert trainer() is None  # its adapter, gradients and Adam state are gone
    assert not any(m.startswith(session_id) for m in service.latest)

    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as later:
        restored = later.create_training_client_from_state_with_optimizer(report["state"])
        restored = restored.result()
        tokens = list(range(40, 60))
        sft = datum(tokens, weights=np.ones(len(tokens) - 1))
        out = restored.forward([sft], "cross_entropy").result().loss_fn_outputs[0]
        expected = np.array(report["logprobs"], dtype=np.float32)
        assert np.array_equal(out["logprobs"].to_numpy(), expected)
        sampler = later.create_sampling_client(model_path=report["weights"]).result()
        params = types.SamplingParams(max_tokens=6, seed=5, stop=[])
        prompt = types.ModelInput.from_ints([40, 41, 42])
        seq = sampler.sample(prompt, 1, params).result().sequences[0]
        assert list(seq.tokens) == report["tokens"]
        assert list(seq.logprobs) == report["sample_logprobs"]


def test_heartbeats_alone_keep_an_idle_session_then_silence_ends_it(served, tiny_model_dir):
    """The SDK's own heartbeat call, every 0.5 s for twice the TTL, keeps a session whose
    client sends nothing else; once they stop it expires, and a heartbeat is then answered
    410, which is what stops the SDK's heartbeat loop."""
    from tinker._client import AsyncTinker  # the client the SDK's ServiceClient sends with

    url, service = served
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    trainer = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    session_id = trainer.model_id.split(":")[0]

    async def heartbeats(count: int) -> list[int]:
        statuses = []
        async with AsyncTinker(base_url=url, api_key=API_KEY, max_retries=0) as sdk:
            for _ in range(count):
                try:
                    await sdk.service.session_heartbeat(session_id=session_id)
                    statuses.append(200)
                except tinker.APIStatusError as exc:
                    statuses.append(exc.status_code)
                await asyncio.sleep(0.5)
        return statuses

    try:
        assert asyncio.run(heartbeats(int(4 * TTL_S))) == [200] * int(4 * TTL_S)
        assert trainer.model_id in service.models.models
        wait_for(lambda: service.sessions.is_ended(session_id), 30, "expired")
        assert asyncio.run(heartbeats(1)) == [410]
        wait_for(lambda: trainer.model_id not in service.models.models, 10, "released")
    finally:
        client.close("success")


def test_closing_the_client_ends_its_session_at_once(served, tiny_model_dir):
    url, service = served
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as client:
        trainer = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4)
        model_id = trainer.result().model_id
    session_id = model_id.split(":")[0]
    assert service.sessions.how_ended(session_id) == "closed"
    wait_for(lambda: model_id not in service.models.models, 10, "released")

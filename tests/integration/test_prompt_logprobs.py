"""Prompt log-probs (`prompt_logprobs`, vLLM's field) over real HTTP, against a plain
transformers forward of the same fp32 model: every prompt token's log-prob, its rank and
the top-k, whatever the sampling settings, for prompts within and beyond one prefill
chunk, repeated prompts (which would hit the prefix cache) and n > 1; vLLM's response
shape; `EngineClient.complete(prompt_logprobs=k)`; bad values refused naming the field.
"""

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.inference.client import EngineClient

CHUNK = 32
ENGINE_SETTINGS = dict(max_num_seqs=8, prefill_chunk_size=CHUNK)  # conftest.py's `server`
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logp(model, prompt: list[int]) -> torch.Tensor:
    """(L, V): log_softmax of the plain forward's logits at every prompt position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 250 + 3 for i in range(length)]


def post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def check_against_reference(positions: list, prompt: list[int], logp: torch.Tensor, k: int):
    """vLLM's shape, and every number equal to the reference's."""
    assert len(positions) == len(prompt) and positions[0] is None
    for p in range(1, len(prompt)):
        entries = positions[p]
        token = prompt[p]
        want = logp[p - 1]  # the logits at p - 1 predict token p
        mine = entries[str(token)]
        assert set(mine) == {"logprob", "rank", "decoded_token"}
        assert abs(mine["logprob"] - want[token].item()) < TOL
        # rank: tokens at least as likely, itself included (bounds absorb the tolerance)
        low = int((want > want[token] + TOL).sum()) + 1
        high = int((want >= want[token] - TOL).sum())
        assert low <= mine["rank"] <= high
        top_values, top_ids = want.topk(k)
        ranked = sorted(entries.items(), key=lambda item: item[1]["rank"])[:k]
        assert [int(t) for t, _ in ranked] == top_ids.tolist()
        assert [e["rank"] for _, e in ranked] == list(range(1, k + 1))
        for (_, e), value in zip(ranked, top_values.tolist(), strict=True):
            assert abs(e["logprob"] - value) < TOL
        assert len(entries) == k + (token not in top_ids.tolist())


def test_prompt_logprobs_equal_a_plain_forward_within_and_beyond_one_chunk(server, reference):
    for length in (7, 3 * CHUNK + 5):
        prompt = prompt_of(length)
        answer = post(server, prompt=prompt, max_tokens=2, n=2, prompt_logprobs=4)
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
        check_against_reference(
            choices[0]["prompt_logprobs"], prompt, reference_logp(reference, prompt), 4
        )


def test_the_raw_distribution_whatever_the_sampling_settings(server, reference):
    prompt = prompt_of(20, salt=1)
    sampled = dict(temperature=0.3, top_k=2, top_p=0.5, seed=4)
    answer = post(server, prompt=prompt, max_tokens=3, prompt_logprobs=3, **sampled)
    positions = answer.json()["choices"][0]["prompt_logprobs"]
    check_against_reference(positions, prompt, reference_logp(reference, prompt), 3)


def test_a_repeated_prompt_is_scored_whole_and_not_read_from_the_prefix_cache(server, reference):
    prompt = prompt_of(2 * CHUNK + 9, salt=2)  # several full prefix-cache blocks
    logp = reference_logp(reference, prompt)

    async def cached_tokens() -> int:
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            return (await client.server_info())["stats"]["cached_prompt_tokens"]

    assert post(server, prompt=prompt, max_tokens=1).status_code == 200  # fills the cache
    before = asyncio.run(cached_tokens())
    for _ in range(2):
        answer = post(server, prompt=prompt, max_tokens=1, prompt_logprobs=2)
        check_against_reference(answer.json()["choices"][0]["prompt_logprobs"], prompt, logp, 2)
    assert asyncio.run(cached_tokens()) == before  # bypassed
    assert post(server, prompt=prompt, max_tokens=1).status_code == 200
    assert asyncio.run(cached_tokens()) > before  # while plain requests still hit


def test_no_prompt_logprobs_unless_asked_and_k_zero_gives_the_prompt_tokens_only(server):
    prompt = prompt_of(9, salt=3)
    plain = post(server, prompt=prompt, max_tokens=2, n=2).json()
    assert [c["prompt_logprobs"] for c in plain["choices"]] == [None, None]
    positions = post(server, prompt=prompt, max_tokens=1, prompt_logprobs=0).json()
    positions = positions["choices"][0]["prompt_logprobs"]
    assert positions[0] is None
    assert [list(entry) for entry in positions[1:]] == [[str(t)] for t in prompt[1:]]


def test_client_parses_prompt_logprobs_and_top_k(server, reference, tiny_model_dir):
    prompt = prompt_of(CHUNK + 3, salt=4)
    logp = reference_logp(reference, prompt)

    async def scenario():
        async with EngineClient(server.base_url) as client:
            scored = await client.complete(prompt, n=2, max_tokens=2, prompt_logprobs=3)
            zero = await client.complete(prompt, max_tokens=1, prompt_logprobs=0)
            plain = await client.complete(prompt, max_tokens=1)
            return scored, zero, plain

    scored, zero, plain = asyncio.run(scenario())
    assert len(scored.samples) == 2
    assert scored.prompt_logprobs[0] is None and scored.prompt_top_logprobs[0] is None
    want = [logp[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(scored.prompt_logprobs[1:], want, strict=True)) < TOL
    for p in range(1, len(prompt)):
        values, ids = logp[p - 1].topk(3)
        top = scored.prompt_top_logprobs[p]
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(top, values.tolist(), strict=True)) < TOL
    assert zero.prompt_logprobs == pytest.approx(scored.prompt_logprobs, abs=1e-6)
    assert zero.prompt_top_logprobs is None
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None


def test_bad_prompt_logprobs_are_a_400_naming_the_field(server):
    prompt = prompt_of(5)
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"stream": True}):
        body = {"prompt_logprobs": 2, **bad}
        answer = post(server, prompt=prompt, max_tokens=1, **body)
        assert answer.status_code == 400, (bad, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "prompt_logprobs" and "prompt_logprobs" in error["message"]
    assert post(server, prompt=prompt, max_tokens=1, prompt_logprobs=20).status_code == 200


def test_chat_reports_prompt_logprobs_at_the_top_level_as_vllm_does(server, reference):
    body = {
        "messages": [{"role": "user", "content": "What is 12 + 7?"}],
        "max_tokens": 2,
        "n": 2,
        "return_token_ids": True,
    }
    url = f"{server.base_url}/v1/chat/completions"
    scored = httpx.post(url, json={**body, "prompt_logprobs": 2}, timeout=60).json()
    prompt = scored["prompt_token_ids"]
    check_against_reference(scored["prompt_logprobs"], prompt, reference_logp(reference, prompt), 2)
    assert httpx.post(url, json=body, timeout=60).json()["prompt_logprobs"] is None
    streamed = httpx.post(url, json={**body, "prompt_logprobs": 2, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_several_prompts_each_get_their_own_prompt_logprobs(server, reference):
    prompts = [prompt_of(6, salt=5), prompt_of(CHUNK + 1, salt=6)]
    answer = post(server, prompt=prompts, n=2, max_tokens=1, prompt_logprobs=1).json()
    for choice in answer["choices"]:
        prompt = prompts[choice["index"] // 2]
        check_against_reference(
            choice["prompt_logprobs"], prompt, reference_logp(reference, prompt), 1
        )

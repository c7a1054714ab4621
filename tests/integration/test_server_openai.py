"""`asyncgrpo serve` over real HTTP: the official `openai` client, RL fields, exact log-probs, bad input.

One server (a child process on a tiny random Llama, fp32) serves the whole module.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.inference.client import EngineClient

# the `server` fixture of conftest.py, shared with test_episodes and test_logprob_mismatch
ENGINE_SETTINGS = dict(max_num_seqs=8, served_model_name="tiny", max_body_mb=1)
SHARED_ENGINE = True  # reads only: no weight syncs, every pause resumed


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, completion, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def max_error(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def extra(obj, key):
    return (obj.model_extra or {})[key]


def test_completions_with_openai_client_streamed_and_not(oai, tokenizer, reference):
    prompt = tokenizer.encode("Hello, world! How are you")
    kw = dict(
        model="tiny",
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        seed=3,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    done = oai.completions.create(**kw)
    choice = done.choices[0]
    ids, lps = extra(choice, "token_ids"), choice.logprobs.token_logprobs
    assert len(ids) == len(lps) == len(extra(choice, "weight_versions")) == 12
    assert extra(choice, "prompt_token_ids") == prompt
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 12
    assert max_error(reference_logprobs(reference, prompt, ids), lps) < 1e-4
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)

    streamed_ids, streamed_text, finish = [], "", None
    for chunk in oai.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        streamed_ids += extra(c, "token_ids")
        streamed_text += c.text
        finish = c.finish_reason or finish
    assert streamed_ids == ids and streamed_text == choice.text and finish == "length"


def test_chat_with_openai_client_renders_template_and_reports_rl_fields(oai, tokenizer, reference):
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    kw = dict(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0.7,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    done = oai.chat.completions.create(**kw)
    choice = done.choices[0]
    assert extra(done, "prompt_token_ids") == expected_prompt
    ids = extra(choice, "token_ids")
    lps = [entry.logprob for entry in choice.logprobs.content]
    assert len(ids) == len(lps) == len(extra(choice, "weight_versions")) == 10
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    # the distribution actually sampled from: log_softmax(logits / 0.7)
    assert max_error(reference_logprobs(reference, expected_prompt, ids, 0.7), lps) < 1e-4
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)

    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert extra(chunks[0], "prompt_token_ids") == expected_prompt
    streamed = [t for ch in chunks for t in extra(ch.choices[0], "token_ids")]
    assert streamed == ids
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == choice.message.content


def test_temperature_zero_is_deterministic_and_logprobs_exact(server, tokenizer, reference):
    prompt = tokenizer.encode("What is 12 + 7?")

    async def scenario():
        async with EngineClient(server.base_url) as client:
            a = await client.complete(prompt, n=2, max_tokens=16, temperature=0, ignore_eos=True)
            b = await client.complete(prompt, n=1, max_tokens=16, temperature=0, ignore_eos=True)
            hot = await client.complete(prompt, n=3, max_tokens=16, temperature=1.0, seed=7)
            return a, b, hot

    a, b, hot = asyncio.run(scenario())
    assert a.samples[0].token_ids == a.samples[1].token_ids == b.samples[0].token_ids
    assert a.prompt_token_ids == prompt
    for sample in hot.samples:
        assert len(sample.token_ids) == len(sample.logprobs) == len(sample.weight_versions)
        ref = reference_logprobs(reference, prompt, sample.token_ids)
        assert max_error(ref, sample.logprobs) < 1e-4
        assert sample.weight_versions == [0] * len(sample.token_ids)


def test_several_prompts_give_n_choices_each(oai, tokenizer):
    prompts = [tokenizer.encode("Hello"), tokenizer.encode("def add(a, b):")]
    done = oai.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=4, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [extra(c, "prompt_token_ids") for c in done.choices] == [prompts[0]] * 2 + [
        prompts[1]
    ] * 2
    text = oai.completions.create(model="tiny", prompt=["Hello", "world"], max_tokens=3)
    assert len(text.choices) == 2


def test_stop_string_is_cut_from_text_but_tokens_are_kept(oai, tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    kw = dict(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    free = oai.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    text = free.choices[0].text
    printable = [i for i in range(3, len(text) - 2) if text[i : i + 2].isprintable()]
    at = printable[0]
    stop = text[at : at + 2]
    at = text.find(stop)
    cut = oai.completions.create(
        stop=[stop], extra_body={"ignore_eos": True, "return_token_ids": True}, **kw
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and extra(choice, "stop_reason") == stop
    assert choice.text == text[:at]
    assert tokenizer.decode(extra(choice, "token_ids")).find(stop) >= 0


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, oai):
    url = server.base_url
    with pytest.raises(openai.BadRequestError, match="max_model_len is 512"):
        oai.completions.create(model="tiny", prompt=[5] * 600, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_model_len is 512"):
        oai.completions.create(model="tiny", prompt=[5] * 600, max_tokens=2, stream=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        oai.completions.create(model="tiny", prompt="Hi", max_tokens=2, presence_penalty=1.0)
    with pytest.raises(openai.BadRequestError, match="max_num_seqs"):
        oai.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=50)
    malformed = httpx.post(
        f"{url}/v1/completions", content=b'{"prompt": "Hi", "max_tok', headers=_json
    )
    assert malformed.status_code == 422 and "error" in malformed.json()
    wrong_type = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": "many"})
    assert wrong_type.status_code == 422 and "max_tokens" in wrong_type.json()["error"]["message"]
    huge = httpx.post(
        f"{url}/v1/completions", content=json.dumps({"prompt": "x" * 2_000_000}), headers=_json
    )
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    out = oai.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")


_json = {"Content-Type": "application/json"}


def test_control_routes_need_the_admin_token(server):
    assert httpx.post(f"{server.base_url}/pause").status_code == 401
    bad = httpx.get(f"{server.base_url}/is_paused", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401
    good = httpx.get(
        f"{server.base_url}/is_paused", headers={"Authorization": f"Bearer {server.admin_token}"}
    )
    assert good.status_code == 200 and good.json() == {"is_paused": False}


def test_metrics_count_requests_and_the_engines_tokens(server):
    """`GET /metrics` of a real server, no token: the completion's tokens are counted
    (their rate is the engine's tokens/s) and so is the request, by its route."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = httpx.get(f"{server.base_url}/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = scrape()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 7, "ignore_eos": True}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body).status_code == 200
    after = scrape()

    def moved(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert moved("asyncgrpo_engine_generated_tokens_total") == 7
    assert moved("asyncgrpo_engine_prompt_tokens_total") == 3
    route = (("method", "POST"), ("route", "/v1/completions"), ("status", "200"))
    assert moved("asyncgrpo_http_requests_total", route) == 1
    assert moved("asyncgrpo_engine_busy_seconds_total") > 0


async def _running(client: EngineClient) -> int:
    stats = (await client.server_info())["stats"]
    return stats["running"] + stats["waiting"] + stats["prefilling"]


async def _wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_client_disconnect_frees_the_slot(server, tokenizer):
    """The engine is paused (keep) while the client leaves: only the disconnect can free the slot."""
    body = {"prompt": tokenizer.encode("Hello"), "max_tokens": 500, "ignore_eos": True}

    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            # streamed
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                async with http.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as r:
                    lines = r.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")
                    await client.pause("keep")
                    assert await _running(client) == 1
            await _wait_until(lambda: _zero(client))
            await client.resume()
            # not streamed
            http = httpx.AsyncClient(base_url=server.base_url, timeout=30)
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            await _wait_until(lambda: _positive(client))
            await client.pause("keep")
            assert await _running(client) == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await http.aclose()
            await _wait_until(lambda: _zero(client))
            await client.resume()
            again = await client.complete(tokenizer.encode("Hi"), max_tokens=2)
            assert len(again.samples[0].token_ids) >= 1

    async def _zero(client):
        return await _running(client) == 0

    async def _positive(client):
        return await _running(client) > 0

    asyncio.run(scenario())

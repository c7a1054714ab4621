"""Agent episodes on a real `asyncgrpo serve` (tiny random Llama): the official openai client,
exact training tokens across turns, episode security, SDK retries.

The random model's sampled pieces rarely re-encode to themselves, so a sample
rebuilt from chat text would differ from the engine's ids; the test checks that.
"""

import asyncio
import json

import httpx
import openai
import pytest
from gateway_scenarios import assert_an_sdk_retry_is_answered_once, extra
from transformers import AutoTokenizer

from asyncgrpo.base.episode import StopReason
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.server.trajectory import ChatRenderer
from asyncgrpo.learning.agents.runner import run_episode

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


# the `server` fixture of conftest.py, shared with test_server_openai and test_logprob_mismatch
ENGINE_SETTINGS = dict(max_num_seqs=8, served_model_name="tiny", max_body_mb=1)
SHARED_ENGINE = True  # reads only: no weight syncs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def admin(server):
    return EngineClient(server.base_url, admin_token=server.admin_token)


def test_three_turn_tool_episode_trains_on_the_engine_tokens(server, tokenizer):
    calls = []  # (prompt ids, sampled ids, log-probs, versions) as the client saw them
    final_messages = []

    async def rollout(task, llm):
        messages = [{"role": "user", "content": task["question"]}]
        follow_ups = [
            {"role": "tool", "tool_call_id": "call_0", "content": "19"},
            {"role": "user", "content": "So what is it?"},
        ]
        async with llm.client() as oai:
            for turn in range(3):
                response = await oai.chat.completions.create(
                    model=llm.model,
                    messages=messages,
                    tools=[CALCULATOR],
                    max_tokens=12,
                    temperature=1.0,
                    seed=turn,
                    logprobs=True,
                    extra_body={"return_token_ids": True},
                )
                choice = response.choices[0]
                calls.append(
                    (
                        extra(response, "prompt_token_ids"),
                        extra(choice, "token_ids"),
                        [entry.logprob for entry in choice.logprobs.content],
                        extra(choice, "weight_versions"),
                    )
                )
                messages.append({"role": "assistant", "content": choice.message.content})
                messages += follow_ups[turn : turn + 1]
        final_messages.extend(messages)
        return 1.0

    async def scenario():
        async with admin(server) as client:
            return await run_episode(client, rollout, {"question": "What is 12 + 7?"})

    outcome = asyncio.run(scenario())
    assert outcome.stop_reason == StopReason.OK and outcome.reward == 1.0 and outcome.trainable
    assert outcome.metrics.turns == 3 and outcome.metrics.prompt_mismatches == 0
    [sample] = outcome.samples
    # each prompt is the previous prompt + its sampled ids + the bridge (new messages)
    for (prompt, ids, _, _), (next_prompt, _, _, _) in zip(calls, calls[1:]):
        assert next_prompt[: len(prompt) + len(ids)] == prompt + ids
    last_prompt, last_ids, _, _ = calls[-1]
    assert sample.input_ids == last_prompt + last_ids
    # the loss mask covers exactly the sampled tokens, with their log-probs and versions
    sampled_at = []
    for prompt, ids, _, _ in calls:
        sampled_at += range(len(prompt), len(prompt) + len(ids))
    assert [t for t, m in enumerate(sample.loss_mask) if m] == sampled_at
    assert [sample.logprobs[t] for t in sampled_at] == pytest.approx(
        [lp for _, _, lps, _ in calls for lp in lps]
    )
    assert [sample.versions[t] for t in sampled_at] == [v for *_, vs in calls for v in vs]
    # the premise: re-tokenizing the conversation would have trained on other ids
    renderer = ChatRenderer(tokenizer, [CALCULATOR])
    assert renderer.prompt_ids(final_messages[:-1]) != last_prompt
    assert "Evaluate an arithmetic expression." in tokenizer.decode(calls[0][0])  # fallback


def test_episode_security(server):
    async def scenario():
        async with admin(server) as client:
            a, b = await client.open_episode(), await client.open_episode()
            url = server.base_url

            def oai(episode_path, key):
                return openai.AsyncOpenAI(base_url=url + episode_path, api_key=key, max_retries=0)

            hi = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            async with oai(a["base_path"], a["api_key"]) as own:
                assert (await own.chat.completions.create(**hi)).choices[0].message is not None
            async with oai(a["base_path"], b["api_key"]) as stolen:
                with pytest.raises(openai.AuthenticationError):
                    await stolen.chat.completions.create(**hi)
            async with oai("/e/no-such-episode/v1", a["api_key"]) as unknown:
                with pytest.raises(openai.AuthenticationError):
                    await unknown.chat.completions.create(**hi)
            closed = await client.close_episode(a["episode_id"], 0.0)
            assert closed["metrics"]["turns"] == 1
            async with oai(a["base_path"], a["api_key"]) as late:
                with pytest.raises(openai.ConflictError):
                    await late.chat.completions.create(**hi)
            async with httpx.AsyncClient(base_url=url) as http:
                assert (await http.post("/episodes")).status_code == 401
                assert (await http.get(f"/episodes/{b['episode_id']}")).status_code == 401
                close_b = await http.post(
                    f"/episodes/{b['episode_id']}/close",
                    json={"reward": 1.0},
                    headers={"Authorization": f"Bearer {b['api_key']}"},  # not the admin token
                )
                assert close_b.status_code == 401
                huge = await http.post(
                    f"{b['base_path']}/chat/completions",
                    content=json.dumps({"messages": [{"role": "user", "content": "x" * 2**21}]}),
                    headers={"Authorization": f"Bearer {b['api_key']}"},
                )
                assert huge.status_code == 413
            await client.close_episode(b["episode_id"], None, "infra_error")
            return await client.episode_stats()

    stats = asyncio.run(scenario())
    assert stats["open"] == 0


def test_sdk_retry_does_not_fork_or_duplicate_the_turn(server):
    assert_an_sdk_retry_is_answered_once(server.base_url, server.admin_token)

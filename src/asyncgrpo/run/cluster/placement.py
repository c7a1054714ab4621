"""One Ray placement group per run: a bundle for each engine replica and trainer rank.

Reserving every bundle up front means a run either gets all its resources or
says, before any model loads, which bundle the cluster cannot hold (Ray itself
would leave it pending forever). Custom resources put each role on its nodes: a
node started with `ray start --resources '{"engine": 1}'` takes the bundles that
ask for `engine`. Where an actor landed, and how weights reach each engine, is
logged and written to `RUN_DIR/cluster.json`.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from asyncgrpo.base.config import ClusterConfig, ConfigError
from asyncgrpo.run.cluster import require_ray

logger = logging.getLogger(__name__)


class RayCluster:
    """The Ray connection, placement group and actors of one run (driver side)."""

    def __init__(self, cfg: ClusterConfig, run_dir: Path, engines: int, trainer_ranks: int):
        self.ray = require_ray()
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.started_here = False
        self.group = None
        self.actors: list[Any] = []
        self.record: dict[str, Any] = {"engines": {}, "trainer_ranks": {}}
        self._lock = threading.Lock()
        self._connect()
        self.driver_node = self.ray.get_runtime_context().get_node_id()
        self.driver_ip = self.ray.util.get_node_ip_address()
        self.record["driver"] = {"node": self.driver_node, "ip": self.driver_ip}
        gpus = self.ray.cluster_resources().get("GPU", 0) > 0
        default = {"GPU": 1.0} if gpus else {"CPU": 1.0}
        self.engine_bundle = dict(cfg.engine_resources or default)
        self.trainer_bundle = dict(cfg.trainer_resources or cfg.engine_resources or default)
        self.bundles = [self.engine_bundle] * engines + [self.trainer_bundle] * trainer_ranks
        self.engines = engines
        self._reserve()

    def _connect(self) -> None:
        if self.ray.is_initialized():  # a user's own ray.init() before the API call
            return
        address = self.cfg.address or "local"  # a new instance, even where one already runs
        logger.info("connecting to Ray at %s", address)
        try:
            self.ray.init(address=address, include_dashboard=False, log_to_driver=True)
        except ConnectionError as exc:
            raise ConfigError(
                f"cluster.address {address!r}: no Ray cluster there ({exc})"
            ) from None
        self.started_here = True

    def _reserve(self) -> None:
        from ray.util.placement_group import placement_group

        have = self.ray.cluster_resources()
        short = _shortfall(self.bundles, have)
        if short and self.started_here:  # a Ray started here has no autoscaler to wait for
            self._refuse(f"more than this machine's Ray offers ({short})", have)
        self.group = placement_group(self.bundles, strategy=self.cfg.placement_strategy)
        if not self.group.wait(timeout_seconds=self.cfg.placement_timeout_s):
            wait = f"within {self.cfg.placement_timeout_s:g} s (cluster.placement_timeout_s)"
            self._refuse(wait, self.ray.cluster_resources())

    def _refuse(self, why: str, have: dict[str, float]) -> None:
        self.shutdown()
        raise ConfigError(
            f"the Ray cluster cannot grant the run's bundles {why}: asked {self.engines} x "
            f"{self.engine_bundle} (cluster.engine_resources, one per engine replica) and "
            f"{len(self.bundles) - self.engines} x {self.trainer_bundle} "
            f"(cluster.trainer_resources, one per trainer rank after the first), "
            f"{self.cfg.placement_strategy}; the cluster has {_brief(have)}"
        )

    def bundle_node(self, bundle: int) -> str:
        """The id of the node that holds bundle `bundle` (known once the group is ready)."""
        from ray.util.placement_group import placement_group_table

        return placement_group_table(self.group)["bundles_to_node_id"][bundle]

    def options(self, bundle: int, **extra: Any) -> dict[str, Any]:
        """Actor options that put it in bundle `bundle` and ask for all of its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = dict(self.bundles[bundle])
        return {
            "num_cpus": resources.pop("CPU", 0),
            "num_gpus": resources.pop("GPU", 0),
            "resources": resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=bundle
            ),
            **extra,
        }

    def start(self, actor_class: Any, bundle: int, *args: Any, **options: Any) -> Any:
        """An actor of `actor_class` (a `ray.remote` class) in bundle `bundle`."""
        actor = actor_class.options(**self.options(bundle, **options)).remote(*args)
        self.actors.append(actor)
        return actor

    def note(self, role: str, key: int, where: dict[str, Any]) -> None:
        """Record where an actor of `role` (engines, trainer_ranks) runs; rewrite cluster.json."""
        with self._lock:
            self.record[role][str(key)] = where
            path = self.run_dir / "cluster.json"
            path.write_text(json.dumps(self.record, indent=1, sort_keys=True))

    def shutdown(self) -> None:
        """Kill the actors, free the bundles, and stop Ray if this run started it."""
        ray = self.ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors.clear()
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:
                logger.debug("removing the placement group failed", exc_info=True)
            self.group = None
        if self.started_here and ray.is_initialized():
            ray.shutdown()
            self.started_here = False


def _shortfall(bundles: list[dict[str, float]], have: dict[str, float]) -> str:
    """The resources `bundles` ask more of in total than `have` holds ('' if none)."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0)}
    return ", ".join(f"{k}: {v:g} asked, {have.get(k, 0.0):g} there" for k, v in short.items())


def _brief(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "memory", "object"))}
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) or "nothing"

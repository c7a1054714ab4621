"""The `cluster:` section: where the run's processes go (one machine, or a Ray cluster).

With `launcher: local` (the default) everything runs on this machine, as it always
has. With `launcher: ray` the engine replicas and the trainer ranks other than rank 0
become Ray actors in one placement group; this process (the driver) stays trainer
rank 0 and keeps the run directory, metrics and progress display.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncgrpo.base.config.base import Section


class ClusterConfig(Section):
    launcher: Literal["local", "ray"] = "local"
    """`local`: every process on this machine. `ray`: engines and trainer ranks 1..N-1 as
    Ray actors (`pip install 'asyncgrpo[ray]'`); this process is trainer rank 0."""
    address: str | None = None
    """The Ray cluster to join: `auto` (the one `ray start` made on this node) or `HOST:PORT`
    of its head; the driver must run on a node of the cluster (it is trainer rank 0, and
    the other ranks and engines connect back to it). None: start a Ray instance here."""
    engine_resources: dict[str, float] | None = None
    """One engine replica's bundle, e.g. `{GPU: 1, CPU: 4}` or `{engine: 1}` (a custom
    resource given to `ray start --resources`). None: one GPU where the cluster has GPUs,
    else one CPU."""
    trainer_resources: dict[str, float] | None = None
    """One trainer rank's bundle (ranks 1..N-1; rank 0 is this process, wherever it runs).
    None: like `engine_resources`."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy over all bundles. Custom resources decide the node of
    each role; the strategy only breaks ties."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for the cluster to grant the bundles before giving up (a bundle no
    node can hold waits forever in Ray; this says which one)."""
    max_engine_restarts: int = Field(3, ge=0)
    """Times Ray restarts a dead engine actor (its engine is re-synced, its requests retried)."""

    @field_validator("address")
    @classmethod
    def _on_the_cluster(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("ray://"):
            raise ValueError(
                "ray:// (Ray Client) runs this process off the cluster, but it is trainer "
                "rank 0 and the engines and ranks connect back to it: run `asyncgrpo train` "
                "on a node of the cluster with address auto (or HEAD_IP:6379)"
            )
        return value

    @field_validator("engine_resources", "trainer_resources")
    @classmethod
    def _positive(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and (not value or any(v <= 0 for v in value.values())):
            raise ValueError("a bundle names at least one resource, each with an amount > 0")
        return value

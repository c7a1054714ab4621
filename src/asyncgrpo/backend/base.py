"""The `EngineBackend` protocol, and the weight-sync steps every backend shares.

Everything the trainer process does to an engine goes through this boundary, so
a vLLM server, several replicas or a Ray actor are new implementations, not
new branches in the training loop. Methods are coroutines on the rollout loop
(`loop_thread.py`), except `launch`, which only starts a process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from asyncgrpo.client import EngineClient

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class EngineDied(RuntimeError):
    """The engine died and could not be brought back (restarts exhausted or impossible)."""


class EngineBackend(Protocol):
    """The engine(s) that sample for this run, seen from the trainer."""

    client: EngineClient
    """Client for generation and control requests; its retries ride out a restart."""

    restarts: int
    """Times the engine was restarted after dying."""

    @property
    def base_urls(self) -> list[str]:
        """Where the engine(s) answer (agents' per-episode URLs are built on these)."""
        ...

    def launch(self) -> None:
        """Begin starting the engine without waiting, so it loads while the trainer loads."""
        ...

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        """Wait until the engine answers health checks (`engine.startup_timeout_s`).

        `layout`, the weights the first sync will send, lets the transport prepare
        its buffers meanwhile.
        """
        ...

    async def healthy(self) -> bool:
        """True when the engine answers now."""
        ...

    async def revive(self) -> bool:
        """Restart the engine if it died; True when it did (it then holds its initial
        weights, so the caller syncs again). Raises `EngineDied` if it cannot."""
        ...

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        """Pause (`mode`: keep, abort or wait), transfer, resume: the engine samples with
        `weights`, stamping tokens with `version`. An engine that dies meanwhile is
        restarted and the sync repeated."""
        ...

    async def close(self) -> None:
        """Stop what this backend started and release the client and the transport."""
        ...


async def publish(client: EngineClient, transport, weights: NamedTensors, version: int, mode: str):
    """The four-step sync on one engine: pause, send, finish with `version`, resume."""
    await client.pause(mode)
    await transport.publish(weights, version)
    await client.resume()

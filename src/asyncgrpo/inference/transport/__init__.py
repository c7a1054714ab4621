"""Weight transports: how the trainer's tensors reach the engine.

Every transport drives the same four engine calls (vLLM's weight-update
protocol): `init_weight_transfer_engine` (which backend), `start_weight_update`,
one or more `update_weights`, and `finish_weight_update` with the new version,
which the engine applies together with the weights in one step. They differ
only in how the bytes travel, and all of them move a safetensors image
(`layout.py`), never a pickle:

- `shm`  (default, same host): one copy into a shared-memory file the engine maps;
- `disk` (shared filesystem): a safetensors file in a directory, as vLLM's disk backend;
- `http` (any host): the safetensors bytes as the request body.

`make_transport(kind, client)` picks one by name (the config's `type`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

# A model's weights as the trainer hands them over: (name, tensor) pairs in publish order.
NamedTensors = Sequence[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    """Publishes a full set of weights to one engine."""

    async def publish(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Send the tensors (state_dict names) and make them live as `version`, atomically."""
        ...

    async def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Get ready to send tensors of this layout, e.g. while the engine starts; optional."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (shared-memory segments, temporary files)."""
        ...


def make_transport(kind: str, client, weights_dir: str | None = None, **options) -> WeightTransport:
    """`kind` is "shm", "disk" or "http"; `client` is an `EngineClient`.

    `weights_dir`: the engine's `weights_dir`, where the disk transport must write (the
    engine reads only there); None keeps each transport's default.
    """
    if kind == "disk" and weights_dir:
        options.setdefault("directory", weights_dir)
    if kind == "shm":
        from asyncgrpo.inference.transport.shm import ShmTransport

        return ShmTransport(client, **options)
    if kind == "disk":
        from asyncgrpo.inference.transport.disk import DiskTransport

        return DiskTransport(client, **options)
    if kind == "http":
        from asyncgrpo.inference.transport.http import HttpTransport

        return HttpTransport(client, **options)
    raise ValueError(f"unknown weight transport {kind!r}; expected 'shm', 'disk' or 'http'")


__all__ = ["WeightTransport", "make_transport"]

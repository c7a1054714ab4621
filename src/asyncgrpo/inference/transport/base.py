"""The four-step publish shared by every transport; subclasses only move bytes."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class FourStepTransport:
    """init -> start -> send (backend-specific) -> finish(version)."""

    backend = ""

    def __init__(self, client):
        self.client = client

    async def publish(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        tensors = [(name, t.detach()) for name, t in named_tensors]
        # init every time: cheap, and an engine that restarted has forgotten the backend
        await self.client.init_weight_transfer_engine(self.backend)
        await self.client.start_weight_update()
        await self.send(tensors)
        await self.client.finish_weight_update(int(version))

    async def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Get ready to send tensors of this layout (before the engine is up); optional."""
        return None

    async def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        return None

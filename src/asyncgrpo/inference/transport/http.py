"""Weight transport as safetensors bytes in HTTP request bodies (works across hosts).

No shared filesystem needed: the weights are serialized into one buffer per
chunk (one copy) and streamed as the body of `/update_weights`. Chunks keep each
body under the server's weight-body limit (`asyncgrpo serve --max-weight-body-mb`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from asyncgrpo.base.hardware import one_thread
from asyncgrpo.inference.transport.base import FourStepTransport
from asyncgrpo.inference.transport.layout import plan_layout, write_image

PIECE_BYTES = 1 << 20  # size of the pieces the body is streamed in


def split_by_size(tensors: list[tuple[str, torch.Tensor]], max_bytes: int):
    """Consecutive groups of tensors of at most `max_bytes` each (a bigger tensor goes alone)."""
    group, size = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += nbytes
    if group:
        yield group


class HttpTransport(FourStepTransport):
    backend = "http"

    def __init__(self, client, max_chunk_bytes: int = 512 * 2**20):
        super().__init__(client)
        self.max_chunk_bytes = max_chunk_bytes

    async def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for group in split_by_size(tensors, self.max_chunk_bytes):
            layout = plan_layout(group)
            buffer = bytearray(layout.total_size)
            await asyncio.to_thread(one_thread(write_image), buffer, layout, group)

            async def body(data: memoryview = memoryview(buffer)) -> AsyncIterator[bytes]:
                for start in range(0, len(data), PIECE_BYTES):
                    yield bytes(data[start : start + PIECE_BYTES])

            await self.client.update_weights_bytes(body, len(buffer))

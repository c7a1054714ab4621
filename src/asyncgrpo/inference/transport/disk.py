"""Weight transport through a safetensors file in a directory both sides can read.

Matches vLLM's disk backend: the engine is told a directory and loads every
`*.safetensors` file in it. Useful across containers that share a volume, or to
keep a copy of what was published. The file is written beside its final name
and renamed into place, so the engine never reads a half-written file.

The engine reads only regular files under its `engine.weights_dir` (give that
directory here), or by default in an `asyncgrpo-weights-*` directory of its temp
directory, which is what this transport creates when given none.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import torch

from asyncgrpo.base.hardware import one_thread
from asyncgrpo.inference.transport.base import FourStepTransport
from asyncgrpo.inference.transport.layout import Layout, plan_layout, write_image

WEIGHTS_FILE = "model.safetensors"
# the engine reads disk weights only from such directories in its temp dir (or engine.weights_dir)
DIRECTORY_PREFIX = "asyncgrpo-weights-"


def write_safetensors_file(
    path: Path, layout: Layout, tensors: list[tuple[str, torch.Tensor]]
) -> None:
    """Write a safetensors file through a memory map: one copy per tensor, then an atomic rename."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w+b") as f:
        f.truncate(layout.total_size)
        with mmap.mmap(f.fileno(), layout.total_size) as buffer:
            write_image(buffer, layout, tensors)
            buffer.flush()
    os.replace(partial, path)


class DiskTransport(FourStepTransport):
    backend = "disk"

    def __init__(self, client, directory: str | Path | None = None):
        super().__init__(client)
        self._owned = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix=DIRECTORY_PREFIX))
        self.directory.mkdir(parents=True, exist_ok=True)

    async def send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        layout = plan_layout(tensors)
        await asyncio.to_thread(
            one_thread(write_safetensors_file), self.directory / WEIGHTS_FILE, layout, tensors
        )
        await self.client.update_weights({"path": str(self.directory)})

    async def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)

"""The engine side of the four-step weight update: stage tensors, then swap them in at once.

`init_weight_transfer_engine` picks the backend; `start_weight_update` opens a
session; each `update_weights` stages tensors — as views over the shared-memory
segment or the request body when possible, so nothing is copied yet;
`finish_weight_update` hands everything to `Engine.update_weights(...,
version=)`, which copies the tensors into the model and changes the version
stamp in one engine command between two decode steps. Until finish, generation
continues on the old weights; a failed session changes nothing.

Payloads are safetensors images or raw tensors described by JSON (see
`asyncgrpo.transport.layout`); nothing is ever unpickled. The paths given to
the `shm` and `disk` backends are read with the server's permissions, which is
why these routes require the admin token.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

from asyncgrpo.engine.types import EngineError
from asyncgrpo.transport.layout import (
    LayoutError,
    read_safetensors_slots,
    slots_from_description,
    view,
)

BACKENDS = ("shm", "disk", "http")


class WeightReceiver:
    """One weight-update session at a time for one engine."""

    def __init__(self, engine):
        self.engine = engine
        self.backend: str | None = None
        self._staged: list | None = None  # (name, tensor) pairs; None when no session is open
        self._buffers: list = []  # mappings/bodies the staged views point into
        self.updates = 0

    def init(self, info: dict) -> None:
        backend = info.get("backend")
        if backend not in BACKENDS:
            raise EngineError(
                f"unknown weight transfer backend {backend!r}; expected one of {BACKENDS}"
            )
        self.backend = backend

    def start(self) -> None:
        if self.backend is None:
            raise EngineError("call /init_weight_transfer_engine before /start_weight_update", 409)
        self._reset()
        self._staged = []

    def _require_session(self, backend: str | None = None) -> list:
        if self._staged is None:
            raise EngineError("no weight update in progress: call /start_weight_update first", 409)
        if backend is not None and self.backend != backend:
            raise EngineError(
                f"this payload needs the '{backend}' backend; the engine was initialised with '{self.backend}'"
            )
        return self._staged

    async def add_description(self, info: dict) -> int:
        """JSON `update_info`: a shared-memory segment (`shm`) or a directory (`disk`)."""
        staged = self._require_session()
        if self.backend == "http":
            raise EngineError(
                "the http backend sends safetensors bytes as application/octet-stream"
            )
        path = info.get("path")
        if not isinstance(path, str) or not path:
            raise EngineError("update_info.path is required")
        try:
            if self.backend == "shm":
                tensors = self._map_segment(Path(path), info)
            else:
                tensors = await asyncio.to_thread(_load_directory, Path(path))
        except LayoutError as exc:
            raise EngineError(str(exc)) from None
        except OSError as exc:
            raise EngineError(f"cannot read weights at {path}: {exc.strerror or exc}") from None
        staged.extend(tensors)
        return len(tensors)

    def add_safetensors_bytes(self, buffer: bytearray) -> int:
        """The `http` backend: a safetensors image received as the request body."""
        staged = self._require_session("http")
        try:
            slots = read_safetensors_slots(buffer)
        except LayoutError as exc:
            raise EngineError(str(exc)) from None
        self._buffers.append(buffer)
        staged.extend((slot.name, view(buffer, slot)) for slot in slots)
        return len(slots)

    def _map_segment(self, path: Path, info: dict) -> list:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise EngineError(f"shared-memory segment {path} is empty")
            # private copy-on-write mapping: writable for torch, nothing is ever written back
            mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        slots = slots_from_description(info, size)
        self._buffers.append(mapping)
        return [(slot.name, view(mapping, slot)) for slot in slots]

    async def finish(self, version: int | None) -> int:
        """Swap the staged tensors in and set the version, in one engine command."""
        staged = self._require_session()
        new_version = self.engine.weight_version + 1 if version is None else int(version)
        try:
            if not staged:
                raise EngineError("no tensors were sent in this weight update")
            await self.engine.update_weights(staged, version=new_version)
        finally:
            staged.clear()  # drop the views first so the mappings can be closed
            self._reset()
        self.updates += 1
        return new_version

    def _reset(self) -> None:
        self._staged = None
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            if isinstance(buffer, mmap.mmap):
                try:
                    buffer.close()
                except BufferError:  # a view is still referenced somewhere; GC will unmap
                    pass


def _load_directory(path: Path) -> list:
    """Every tensor of every `*.safetensors` file in a directory (or one file)."""
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no .safetensors files in {path}")
    tensors = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                tensors.extend((name, f.get_tensor(name)) for name in f.keys())
        except OSError:
            raise
        except Exception as exc:  # safetensors raises its own error type for corrupt files
            raise EngineError(f"cannot read {file}: {exc}") from None
    return tensors

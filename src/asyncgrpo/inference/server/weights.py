"""The engine side of the four-step weight update: stage tensors, then swap them in at once.

`init_weight_transfer_engine` picks the backend; `start_weight_update` opens a
session; each `update_weights` stages tensors — as views over the shared-memory
segment or the request body when possible, so nothing is copied yet;
`finish_weight_update` hands everything to `Engine.update_weights(...,
version=)`, which copies the tensors into the model and changes the version
stamp in one engine command between two decode steps. Until finish, generation
continues on the old weights; a failed session changes nothing.

Payloads are safetensors images or raw tensors described by JSON (see
`asyncgrpo.inference.transport.layout`); nothing is ever unpickled. The paths given to
the `shm` and `disk` backends are read with the server's permissions, so besides
the admin token they must lie where the transports write (`WeightPaths`, after
resolving symlinks) and be regular files, opened without blocking (a FIFO is
refused, not waited on) and read off the event loop. A path that breaks the rule
gets the same message whether or not it exists. Dtype and shape are checked
against the model before anything is copied (`Engine.update_weights`).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import stat
import tempfile

from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.inference.transport.disk import DIRECTORY_PREFIX
from asyncgrpo.inference.transport.layout import (
    LayoutError,
    read_safetensors_slots,
    slots_from_description,
    view,
)
from asyncgrpo.inference.transport.shm import SEGMENT_PREFIX, shm_directory

BACKENDS = ("shm", "disk", "http")


class WeightPaths:
    """Where `update_info.path` may point, judged on the path with symlinks resolved.

    shm: a file named `asyncgrpo-weights-*` directly in /dev/shm (`shm_directory()`).
    disk: anything under `weights_dir`; without one, under an `asyncgrpo-weights-*`
    directory of the temp directory (where `DiskTransport` writes by default).
    """

    def __init__(self, weights_dir: str | None = None):
        self.shm_dir = os.path.realpath(shm_directory())
        self.disk_root = os.path.realpath(weights_dir or tempfile.gettempdir())
        self.disk_prefix = "" if weights_dir else DIRECTORY_PREFIX
        self.shm_rule = f"named {os.path.join(self.shm_dir, SEGMENT_PREFIX)}*"
        self.disk_rule = (
            f"under {self.disk_root} (engine.weights_dir)"
            if weights_dir
            else f"under {os.path.join(self.disk_root, DIRECTORY_PREFIX)}* (or engine.weights_dir)"
        )

    def shm_allows(self, real: str) -> bool:
        directory, name = os.path.split(real)
        return directory == self.shm_dir and name.startswith(SEGMENT_PREFIX)

    def disk_allows(self, real: str) -> bool:
        relative = os.path.relpath(real, self.disk_root)
        first = relative.split(os.sep, 1)[0]
        if relative == os.curdir:  # the root itself: only a configured weights_dir
            return not self.disk_prefix
        return first != os.pardir and first.startswith(self.disk_prefix)


class WeightReceiver:
    """One weight-update session at a time for one engine."""

    def __init__(self, engine, weights_dir: str | None = None):
        self.engine = engine
        self.paths = WeightPaths(weights_dir)
        self.backend: str | None = None
        self._staged: list | None = None  # (name, tensor) pairs; None when no session is open
        self._buffers: list = []  # mappings/bodies the staged views point into
        self.updates = 0

    def init(self, info: dict) -> None:
        backend = info.get("backend")
        if backend not in BACKENDS:
            raise RequestError(
                f"unknown weight transfer backend {backend!r}; expected one of {BACKENDS}"
            )
        self.backend = backend

    def start(self) -> None:
        if self.backend is None:
            raise RequestError("call /init_weight_transfer_engine before /start_weight_update", 409)
        self._reset()
        self._staged = []

    def _require_session(self, backend: str | None = None) -> list:
        if self._staged is None:
            raise RequestError("no weight update in progress: call /start_weight_update first", 409)
        if backend is not None and self.backend != backend:
            raise RequestError(
                f"this payload needs the '{backend}' backend; the engine was initialised with '{self.backend}'"
            )
        return self._staged

    async def add_description(self, info: dict) -> int:
        """JSON `update_info`: a shared-memory segment (`shm`) or a directory (`disk`)."""
        staged = self._require_session()
        if self.backend == "http":
            raise RequestError(
                "the http backend sends safetensors bytes as application/octet-stream"
            )
        path = info.get("path")
        if not isinstance(path, str) or not path:
            raise RequestError("update_info.path is required")
        read = self._map_segment if self.backend == "shm" else self._read_disk
        try:
            buffers = await asyncio.to_thread(read, path, info)
        except LayoutError as exc:
            raise RequestError(str(exc)) from None
        if staged is not self._staged:  # a new session started meanwhile: this one is void
            _close_all([buffer for buffer, _ in buffers])
            raise RequestError("the weight update was restarted while this payload was read", 409)
        for buffer, tensors in buffers:
            self._buffers.append(buffer)
            staged.extend(tensors)
        return sum(len(tensors) for _, tensors in buffers)

    def add_safetensors_bytes(self, buffer: bytearray) -> int:
        """The `http` backend: a safetensors image received as the request body."""
        staged = self._require_session("http")
        try:
            slots = read_safetensors_slots(buffer)
        except LayoutError as exc:
            raise RequestError(str(exc)) from None
        self._buffers.append(buffer)
        staged.extend((slot.name, view(buffer, slot)) for slot in slots)
        return len(slots)

    def _map_segment(self, path: str, info: dict) -> list:
        """[(mapping, tensors)]: views over a private mapping of the segment (a worker thread)."""
        fd = _open_allowed(path, self.paths.shm_allows, self.paths.shm_rule)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise RequestError(f"shared-memory segment {path} is empty")
            # private copy-on-write mapping: writable for torch, nothing is ever written back
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        try:
            slots = slots_from_description(info, size)
        except LayoutError:
            mapping.close()
            raise
        return [(mapping, [(slot.name, view(mapping, slot)) for slot in slots])]

    def _read_disk(self, path: str, info: dict) -> list:
        """[(bytes, tensors)] of one file, or of every `*.safetensors` file in a directory.

        The files are read into memory (a worker thread) rather than mapped: a file
        truncated by someone else while mapped would kill the server with SIGBUS.
        """
        allowed, rule = self.paths.disk_allows, self.paths.disk_rule
        real = _resolved(path)
        if not (real and allowed(real) and os.path.isdir(real)):
            return [_read_safetensors(path, allowed, rule)]  # one file, or refused
        names = sorted(n for n in os.listdir(real) if n.endswith(".safetensors"))
        if not names:
            raise RequestError(f"no .safetensors files in {path}")
        return [_read_safetensors(os.path.join(path, name), allowed, rule) for name in names]

    async def finish(self, version: int | None) -> int:
        """Swap the staged tensors in and set the version, in one engine command."""
        staged = self._require_session()
        new_version = self.engine.weight_version + 1 if version is None else int(version)
        try:
            if not staged:
                raise RequestError("no tensors were sent in this weight update")
            await self.engine.update_weights(staged, version=new_version)
        finally:
            staged.clear()  # drop the views first so the mappings can be closed
            self._reset()
        self.updates += 1
        return new_version

    def _reset(self) -> None:
        self._staged = None
        buffers, self._buffers = self._buffers, []
        _close_all(buffers)


def _close_all(buffers: list) -> None:
    for buffer in buffers:
        if isinstance(buffer, mmap.mmap):
            try:
                buffer.close()
            except BufferError:  # a view is still referenced somewhere; GC will unmap
                pass


def _resolved(path: str) -> str | None:
    """`path` with every symlink resolved; None if no file can have that name (a NUL byte)."""
    try:
        return os.path.realpath(path)
    except ValueError:  # also UnicodeEncodeError (a lone surrogate)
        return None


def _open_allowed(path: str, allowed, rule: str) -> int:
    """A read-only descriptor of `path` if it resolves to an allowed regular file.

    Opened with O_NONBLOCK, so a FIFO or a device returns at once and is refused.
    Every refusal reads the same, so it does not tell whether the path exists.
    """
    real = _resolved(path)
    if real and allowed(real):
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            pass
        else:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
    raise RequestError(
        f"cannot read weights at {path!r}: update_info.path must be an existing regular file {rule}"
    )


def _read_safetensors(path: str, allowed, rule: str) -> tuple[bytearray, list]:
    """(bytes, tensors as views over them) of one safetensors file."""
    fd = _open_allowed(path, allowed, rule)
    try:
        buffer = bytearray(os.fstat(fd).st_size)
        filled = 0
        while filled < len(buffer):
            got = os.readv(fd, [memoryview(buffer)[filled:]])
            if got == 0:
                raise RequestError(f"{path} was truncated while it was read")
            filled += got
    finally:
        os.close(fd)
    slots = read_safetensors_slots(buffer)
    return buffer, [(slot.name, view(buffer, slot)) for slot in slots]

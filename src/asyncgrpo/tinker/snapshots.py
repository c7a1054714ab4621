"""Samplers' weights beyond `tinker-serve --max-resident-models` wait on disk, not in memory.

A sampler made by `save_weights_for_sampler` keeps the weights it was saved with, for as
long as its session lives, and an RL loop makes one every step (besides the newest weights
of each model, which its `inflight` samplers follow): without a bound, a long session holds
one adapter-sized copy per step it took. Each set of weights is a `SnapshotWeights`, shared
by every sampler made from it; with a bound of N, beyond N sets in memory the least
recently used one is written to a safetensors file of its own under `--state-dir` and its
tensors leave memory. Its samplers stay as they are (ids, paths, what they follow); the
next sample that needs the weights brings them back, bit for bit.

A set's file is written once (the weights never change) and goes when the last sampler
holding the set does (a finalizer on the set), or at the server's next start, which
empties the directory (`offload.fresh_offload_dir`). The cache's bookkeeping and its disk
writes run under one lock, taken by the trainer's thread when a model publishes new
weights, by a worker thread before a sample, and by a request that opens saved weights
(which reads their file on the event loop already).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file

from asyncgrpo.tinker.offload import LruOrder, write_tensors

NamedTensors = list[tuple[str, torch.Tensor]]


class SnapshotWeights:
    """One set of sampler weights, in memory or in its file; its names and their order stay
    in memory."""

    def __init__(self, tensors: NamedTensors, key: int):
        self.key = key
        self.names = [name for name, _ in tensors]
        self.device = tensors[0][1].device if tensors else torch.device("cpu")
        self._tensors: NamedTensors | None = tensors
        self._file: Path | None = None

    @property
    def resident(self) -> bool:
        return self._tensors is not None

    def tensors(self) -> NamedTensors:
        """The weights: those in memory, else read from the file for this use alone."""
        tensors = self._tensors
        return tensors if tensors is not None else self._read()

    def bring_back(self) -> bool:
        """Into memory (the cache decides when); whether it had to read its file."""
        if self._tensors is not None:
            return False
        self._tensors = self._read()
        return True

    def send_away(self, directory: Path) -> bool:
        """Out of memory, into its file (written the first time); whether it was in."""
        if self._tensors is None:
            return False
        if self._file is None:
            path = Path(directory) / f"snapshot-{self.key}.safetensors"
            write_tensors(path, dict(self._tensors))
            self._file = path
            weakref.finalize(self, path.unlink, True)  # missing_ok: gone with the set
        self._tensors = None
        return True

    def _read(self) -> NamedTensors:
        loaded = load_file(self._file, device=str(self.device))
        return [(name, loaded[name]) for name in self.names]


class SnapshotCache:
    """At most `limit` sets of sampler weights in memory (None: no bound)."""

    def __init__(self, directory: Path, limit: int | None):
        if limit is not None and limit < 1:
            raise ValueError(f"the bound on resident weights must be at least 1, got {limit}")
        self.directory = Path(directory)
        self.limit = limit
        self._keys = itertools.count(1)
        self._lru = LruOrder()  # the keys of the sets in memory
        self._sets: dict[int, weakref.ref[SnapshotWeights]] = {}
        self._away: weakref.WeakSet[SnapshotWeights] = weakref.WeakSet()
        self._lock = threading.Lock()
        self.offloads = self.reloads = 0

    def add(self, tensors: NamedTensors) -> SnapshotWeights:
        """A new set of weights, in memory; with a bound, older sets may leave for it."""
        snapshot = SnapshotWeights(tensors, next(self._keys))
        if self.limit is not None:
            with self._lock:
                self._hold(snapshot)
        return snapshot

    def use(self, snapshot: SnapshotWeights) -> None:
        """A sample is about to run with `snapshot`: in memory, the most recently used."""
        with self._lock:
            if snapshot.bring_back():
                self._away.discard(snapshot)
                self.reloads += 1
            self._hold(snapshot)

    async def use_soon(self, snapshot: SnapshotWeights) -> None:
        """`use`, on a worker thread (it may read and write files); nothing without a bound."""
        if self.limit is not None:
            await asyncio.to_thread(self.use, snapshot)

    def offloaded_count(self) -> int:
        return len(self._away)

    def _hold(self, snapshot: SnapshotWeights) -> None:
        """Under the lock: `snapshot` counts as in memory, and the sets beyond the bound go."""
        self._sets[snapshot.key] = weakref.ref(snapshot)
        self._lru.touch(snapshot.key)
        for key in [k for k in self._lru if self._sets[k]() is None]:  # sets no sampler holds
            self._lru.forget(key)
            del self._sets[key]
        for key in self._lru.victims(self.limit, lambda k: k == snapshot.key):
            victim = self._sets.pop(key)()
            self._lru.forget(key)
            if victim is not None and victim.send_away(self.directory):
                self._away.add(victim)
                self.offloads += 1

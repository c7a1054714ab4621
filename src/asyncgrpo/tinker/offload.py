"""Training models beyond `tinker-serve --max-resident-models` wait on disk, not in memory.

Every model a client creates holds an adapter, its Adam moments and any gradients it has
accumulated; a server whose clients create many models (one per experiment, per seed, per
user) would hold them all until their sessions end. With a bound of N, once more than N
models are in memory the least recently used one is written to a safetensors file under
`--state-dir` (the tensor names of `lora_state.py`: peft's saved names,
`optimizer.<name>.<key>`, `gradient.<name>`; nothing pickled) and leaves memory
(`LoraModels.unload`); its next operation, whatever it is, brings it back
(`LoraModels.reload`) before it runs, bit for bit as it was. What stays in memory is what
identifies and orders the model: its spec, its trainer and step count, its `seq_id` order.

A model with operations queued or running is not taken out (the next least recently used
idle one is); when every other model is busy, memory holds more than N for a while and the
next operation takes the excess out. Everything here runs on the trainer's one thread, the
thread that runs every model's operations, so a model never leaves while it computes.

The files are a cache of memory, not saved states (those are `save_state`'s): a model's
file goes when the model comes back or leaves the server with its session, and the
directory is emptied at start, since no model of a process before survives it.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

OFFLOAD_DIR = "offloaded"  # under --state-dir, beside the `<session>_train_<k>` checkpoint dirs


class LruOrder:
    """Keys from least to most recently used, and which to take out beyond a bound."""

    def __init__(self):
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> None:
        """`key` was used now (added if new)."""
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._order))

    def victims(self, limit: int, spared: Callable[[Hashable], bool]) -> list[Hashable]:
        """The least recently used keys whose removal leaves at most `limit`, skipping those
        `spared(key)` keeps; fewer when too many are spared."""
        excess = len(self._order) - limit
        chosen = []
        for key in self._order:
            if excess <= 0:
                break
            if not spared(key):
                chosen.append(key)
                excess -= 1
        return chosen


def fresh_offload_dir(state_dir: Path) -> Path:
    """`--state-dir`'s offload directory, emptied: what a process before left there belongs
    to sessions that ended with it."""
    directory = Path(state_dir) / OFFLOAD_DIR
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written whole or not at all (a temporary file, then renamed)."""
    partial = path.with_name(path.name + ".partial")
    save_file({name: t.contiguous() for name, t in tensors.items()}, partial)
    os.replace(partial, path)


class ModelOffload:
    """Keeps at most `limit` training models of `LoraModels` in memory (None: no bound).
    Trainer thread only."""

    def __init__(self, models, directory: Path, limit: int | None, orders: Mapping):
        """`models`: the `training.LoraModels`; `directory`: where offloaded models' files
        go; `orders`: model id → its `futures.SeqOrder`, whose `depth` counts the
        operations queued or running."""
        if limit is not None and limit < 1:
            raise ValueError(f"the bound on resident models must be at least 1, got {limit}")
        self.models = models
        self.directory = Path(directory)
        self.limit = limit
        self.orders = orders
        self._lru = LruOrder()  # the models in memory
        self.offloaded: set[str] = set()
        self.offloads = self.reloads = 0

    def added(self, model_id: str) -> None:
        """A model was just created in memory: it counts, and may push an older one out."""
        if self.limit is not None:
            self._lru.touch(model_id)
            self._enforce(model_id)

    def bring_in(self, model_id: str) -> None:
        """`model_id` is about to run an operation: in memory (reloaded if it was out), the
        most recently used, and the bound kept by taking idle others out."""
        if self.limit is None or model_id not in self.models.models:
            return  # a model that left the server: the operation says so itself
        if model_id in self.offloaded:
            path = self.file_of(model_id)
            self.models.reload(model_id, load_file(path))
            self.offloaded.discard(model_id)
            path.unlink(missing_ok=True)
            self.reloads += 1
        self._lru.touch(model_id)
        self._enforce(model_id)

    def run(self, model_id: str, work: Callable[[], Any]) -> Any:
        """`work()` (an operation of the model) once the model is in memory (`bring_in`)."""
        self.bring_in(model_id)
        return work()

    def forget(self, model_id: str) -> None:
        """The model leaves the server (its session ended): its file goes too."""
        self._lru.forget(model_id)
        if model_id in self.offloaded:
            self.offloaded.discard(model_id)
            self.file_of(model_id).unlink(missing_ok=True)

    def busy(self, model_id: str) -> bool:
        """Whether the model has operations queued or running (read while the event loop
        queues more: a model taken out just as an operation arrives is brought back by it)."""
        order = self.orders.get(model_id)
        return order is not None and order.depth > 0

    def _enforce(self, keep: str) -> None:
        spared = lambda model_id: model_id == keep or self.busy(model_id)  # noqa: E731
        for model_id in self._lru.victims(self.limit, spared):
            self._offload(model_id)

    def _offload(self, model_id: str) -> None:
        """Write the model's tensors, then (only once they are on disk) release them."""
        write_tensors(self.file_of(model_id), self.models.memory_tensors(model_id))
        self.models.unload(model_id)
        self._lru.forget(model_id)
        self.offloaded.add(model_id)
        self.offloads += 1

    def file_of(self, model_id: str) -> Path:
        return self.directory / f"model-{model_id.replace(':', '_')}.safetensors"

"""Which vLLM LoRA adapter serves which Tinker sampler's weights: names, use, unloading.

On `tinker-serve --engine vllm` each set of sampler weights is a LoRA adapter that the
vLLM server loads by name (`vllm_sampling.py` does the loading and the requests). This
module is the bookkeeping alone, without I/O, so that its rules are tested without a
server. The weights are named by the keys `sampling_ops` gives them: `("sampler", id)`
for a snapshot sampler's own weights, `("model", id, version)` for one version of the
newest weights of a model, which its `inflight` samplers follow; `("base",)`, the base
model, needs no adapter.

- A name is never reused. Each key gets `<prefix>-<n>`, n counting up, under a prefix
  drawn at random per process: vLLM keys its prefix cache by adapter name, so a reused
  name could serve blocks computed under other weights, and a server attached to by URL
  may still hold the names of an earlier tinker-serve.
- Requests in flight are counted per adapter.
- Before one more adapter is loaded, the adapters no sampler can ask for any more are
  unloaded (their session ended, or their model published newer weights), then the
  least recently used idle ones while the server's LoRA capacity (`--max-loras`, vLLM's
  CPU LoRA cache) would be exceeded. When every loaded adapter has requests running, the
  new one is loaded anyway: vLLM then schedules at most `--max-loras` adapters in a batch
  and reads the others from their directories again.
- Unloading stops new requests only: vLLM finishes the requests running on the adapter,
  so its directory is deleted once none of ours runs on it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BASE_KEY = ("base",)


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter loaded (or about to be) on the vLLM server."""

    key: tuple
    name: str
    path: Path  # its peft adapter directory
    running: int = 0  # our requests in flight on it
    last_used: int = 0  # when a request last started on it (a tick of `AdapterBook`)


class AdapterBook:
    """The adapters loaded for the samplers, and those unloaded whose files still serve a
    request in flight."""

    def __init__(self, directory: Path, prefix: str | None = None):
        """`directory`: where the adapters' directories go (the vLLM server reads them)."""
        self.directory = Path(directory)
        self.prefix = prefix or f"tinker-{secrets.token_hex(4)}"
        self.loaded: dict[tuple, LoadedAdapter] = {}
        self.retired: list[LoadedAdapter] = []
        self._numbers = itertools.count(1)
        self._clock = itertools.count(1)

    def find(self, key: tuple) -> LoadedAdapter | None:
        return self.loaded.get(key)

    def new(self, key: tuple) -> LoadedAdapter:
        """A fresh name and directory for the weights of `key` (`added` once loaded)."""
        name = f"{self.prefix}-{next(self._numbers)}"
        return LoadedAdapter(key, name, self.directory / name)

    def added(self, adapter: LoadedAdapter) -> None:
        self.loaded[adapter.key] = adapter
        adapter.last_used = next(self._clock)

    def started(self, adapter: LoadedAdapter) -> None:
        """A request starts on `adapter`."""
        adapter.running += 1
        adapter.last_used = next(self._clock)

    def finished(self, adapter: LoadedAdapter) -> None:
        adapter.running -= 1

    def to_unload(self, in_use: Callable[[tuple], bool], capacity: int) -> list[LoadedAdapter]:
        """What to unload before one more adapter is loaded: every adapter no sampler can
        ask for any more (`in_use(key)` false), then the least recently used idle ones
        until the loaded ones and the new one fit in `capacity`."""
        stale = [a for a in self.loaded.values() if not in_use(a.key)]
        idle = [a for a in self.loaded.values() if a.running == 0 and a not in stale]
        excess = len(self.loaded) - len(stale) + 1 - capacity
        return stale + sorted(idle, key=lambda a: a.last_used)[: max(0, excess)]

    def unloaded(self, adapter: LoadedAdapter) -> None:
        """The server no longer serves `adapter` to new requests (unloaded, or lost in a
        restart): its files wait for the requests still running on it."""
        if self.loaded.get(adapter.key) is adapter:
            del self.loaded[adapter.key]
        if adapter not in self.retired:
            self.retired.append(adapter)

    def deletable(self) -> list[LoadedAdapter]:
        """The unloaded adapters no request of ours runs on any more, taken off the list:
        their directories may go."""
        done = [a for a in self.retired if a.running <= 0]
        self.retired = [a for a in self.retired if a.running > 0]
        return done

"""LoRA adapter syncs into a vLLM server: adapter directories and vLLM's LoRA routes.

An adapter update (names per `asyncgrpo.inference.adapters`) does not go through the weight
transport. `AdapterLoader` writes it as a peft adapter directory (the scale already
in B, so `lora_alpha == r`), loads it with `/v1/load_lora_adapter` under a versioned
name, and makes the client ask for it (`model`), so every token of a request carries
the version of the adapter it started on. The previous adapter stays loaded for the
requests still running on it; older ones are unloaded and their files deleted.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from pathlib import Path

from asyncgrpo.base.config import ConfigError, VLLMEngineConfig
from asyncgrpo.inference.adapters import (
    AdapterError,
    adapter_pairs,
    is_adapter_update,
    looks_like_adapter,
    save_peft_adapter,
)
from asyncgrpo.inference.transport import NamedTensors
from asyncgrpo.inference.vllm.client import VLLMClient


def adapter_or_weights(weights: NamedTensors) -> tuple[NamedTensors, bool]:
    """(weights, whether they are a LoRA adapter), judged by the first name: a full image
    passes through unread (a generator keeps its first item), an adapter (small) becomes
    a list, checked whole for full weights mixed in."""
    items = iter(weights)
    first = next(items, None)
    if first is None:
        return [], False
    rest = weights if items is not weights else itertools.chain([first], items)
    if not looks_like_adapter(first[0]):
        return rest, False
    adapter = list(rest)
    is_adapter_update(name for name, _ in adapter)  # raises on a mix
    return adapter, True


def adapter_root(cfg: VLLMEngineConfig, log_path: Path | None) -> Path | None:
    """Where adapter directories go: `engine.weights_dir`, else the run directory."""
    if cfg.weights_dir:
        return Path(cfg.weights_dir)
    return log_path.parent if log_path else None


class AdapterLoader:
    """A LoRA run's adapter syncs into one vLLM server, in place of the weight transport
    (`publish` calls it between pause and resume)."""

    def __init__(self, client: VLLMClient, cfg: VLLMEngineConfig, root: Path | None, replica: int):
        self.client = client
        self.max_rank = cfg.max_lora_rank
        self.root = root
        self.replica = replica
        self.directory: Path | None = None  # created at the first sync
        self.loaded: list[tuple[str, Path]] = []  # oldest first; the last is in use
        self.retired: list[tuple[str, Path]] = []  # unloaded; files kept while requests run

    def check(self, weights: NamedTensors) -> None:
        """Refuse an adapter this server cannot take, with a message naming the fix."""
        if self.max_rank is None:
            raise ConfigError(
                "a LoRA adapter reached a vLLM engine started without LoRA serving: the run "
                "must set engine.max_lora_rank to model.lora.r"
            )
        pairs = adapter_pairs(weights)
        rank = max(pair.rank for pair in pairs)
        if rank > self.max_rank:
            raise AdapterError(f"adapter rank {rank} exceeds engine.max_lora_rank {self.max_rank}")

    async def publish(self, weights: NamedTensors, version: int) -> None:
        path = self._directory() / f"asyncgrpo-v{int(version)}"
        # a version loaded again (the sync repeated on a restarted server) is live again
        self.retired = [entry for entry in self.retired if entry[1] != path]
        await asyncio.to_thread(save_peft_adapter, adapter_pairs(weights), path)
        name = await self.client.load_lora_adapter(version, str(path))
        self.client.use_adapter(version)
        self.loaded = [entry for entry in self.loaded if entry[0] != name] + [(name, path)]
        while len(self.loaded) > 2:  # the newest, and the previous one
            old = self.loaded.pop(0)
            await self.client.unload_lora_adapter(old[0])
            self.retired.append(old)
        self._delete_retired()

    def _directory(self) -> Path:
        if self.directory is None:
            name = f"lora-adapters-{self.replica}"
            if self.root is None:
                self.directory = Path(tempfile.mkdtemp(prefix=f"asyncgrpo-{name}-"))
            else:
                self.directory = self.root / name
                self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory

    def _delete_retired(self) -> None:
        running = self.client.adapter_requests
        for name, path in [entry for entry in self.retired if running[entry[0]] <= 0]:
            shutil.rmtree(path, ignore_errors=True)
            self.retired.remove((name, path))

    def forget(self) -> None:
        """The server restarted without adapters: none is loaded any more."""
        self.retired += self.loaded
        self.loaded = []

    async def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

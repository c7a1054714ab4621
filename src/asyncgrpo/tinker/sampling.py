"""Tinker sampling sessions on one engine: which weights each session samples with, and
the engine's switch between them.

A Tinker program holds several samplers at once: the base model, a snapshot saved at step
n (which must keep sampling with step n's weights after step n+1 is saved: an old path
that silently sampled with newer weights would corrupt every importance ratio), and
`inflight` samplers that follow a model's newest weights. The engine holds one set of
weights at a time, so `EngineWeights` lets requests of the loaded sampler run together
and switches to another sampler's weights only when the engine is idle. A switch is a
LoRA adapter sync (tens of milliseconds on the embedded engine: `asyncgrpo.inference.adapters`);
waiting switches are served before new requests of the loaded sampler join, so a busy
sampler cannot starve the others.

On a vLLM server (`tinker-serve --engine vllm`) nothing is switched: each sampler's
weights are a LoRA adapter loaded by name beside the others (`vllm_sampling.VLLMAdapters`).
Both draw a sample the same way (`SamplingEngine`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from asyncgrpo.inference.backend.base import EngineBackend
from asyncgrpo.inference.client.engine_client import Completion
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.sample_wire import SampleCall, SampledSequence, encode_sample_response
from asyncgrpo.tinker.sessions import owner_of
from asyncgrpo.tinker.snapshots import NamedTensors, SnapshotWeights


@dataclass(frozen=True)
class Sampler:
    """A sampling session: fixed weights (`weights`, shared with the samplers made from the
    same ones; None for the base model), or the newest weights of training model `follows`
    (an `inflight` sampler)."""

    sampler_id: str
    base_model: str
    model_path: str | None = None
    weights: SnapshotWeights | None = None
    follows: str | None = None


class SamplingEngine(Protocol):
    """How the service draws a sample with a sampler's weights."""

    async def sample(
        self,
        key: tuple,
        weights: Callable[[], NamedTensors | None],
        call: SampleCall,
        in_use: Callable[[tuple], bool],
    ) -> Completion:
        """Sample `call` with the weights named `key` (`sampling_ops` names them; read by
        `weights()` when needed, None meaning the base model's); `in_use(key)` says whether
        a sampler can still ask for a key's weights."""
        ...

    async def close(self) -> None:
        """Release what the engine holds for the samplers (the backend closes itself)."""
        ...


class EngineWeights:
    """Which sampler's weights the engine holds, switched only while no request runs."""

    def __init__(self, backend: EngineBackend, base_weights: Callable[[], NamedTensors]):
        """`base_weights`: an adapter that leaves every weight at the base (the engine
        restores any weight the loaded adapter does not name)."""
        self.backend = backend
        self._base_weights = base_weights
        self._loaded: tuple | None = ("base",)  # the engine starts with the base weights
        self._running = 0
        self._waiting: Counter[tuple] = Counter()
        self._turn = asyncio.Condition()
        self._versions = itertools.count(1)
        self.switches = 0

    @asynccontextmanager
    async def holding(
        self, key: tuple, weights: Callable[[], NamedTensors | None]
    ) -> AsyncIterator[None]:
        """Run the block while the engine holds the weights named `key` (loaded on demand
        from `weights()`, None meaning the base)."""
        async with self._turn:
            self._waiting[key] += 1
            try:
                await self._turn.wait_for(lambda: self._may_enter(key))
            finally:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
            if self._loaded != key:
                await self._load(key, weights())
            self._running += 1
        try:
            yield
        finally:
            async with self._turn:
                self._running -= 1
                self._turn.notify_all()

    async def sample(self, key, weights, call: SampleCall, in_use) -> Completion:
        """`SamplingEngine.sample` on the engine switched to `key`'s weights (`in_use` is
        not needed: the next switch replaces whatever weights the engine holds)."""
        async with self.holding(key, weights):
            return await self.backend.client.complete(call.prompt.tolist(), **engine_args(call))

    async def close(self) -> None:
        """Nothing to release: the engine's weights go with its process."""

    def _may_enter(self, key: tuple) -> bool:
        if self._loaded == key:
            return not any(k != key for k in self._waiting)  # switches waiting go first
        return self._running == 0

    async def _load(self, key: tuple, weights: NamedTensors | None) -> None:
        self._loaded = None  # a failed sync leaves nothing trusted loaded
        named = weights if weights is not None else self._base_weights()
        await self.backend.sync_weights(named, next(self._versions), "keep")
        self._loaded = key
        self.switches += 1


class SamplerRegistry:
    """Sampling sessions by id, and the saved sampler weights by `tinker://` path."""

    def __init__(self):
        self._samplers: dict[str, Sampler] = {}
        self._saved: dict[str, Sampler] = {}

    def add(self, sampler: Sampler) -> Sampler:
        self._samplers[sampler.sampler_id] = sampler
        if sampler.model_path is not None and sampler.follows is None:
            self._saved[sampler.model_path] = sampler
        return sampler

    def get(self, sampler_id: str) -> Sampler:
        try:
            return self._samplers[sampler_id]
        except KeyError:
            raise TinkerUserError(
                "sampling_session_id", f"unknown sampling session {sampler_id!r}"
            ) from None

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self._samplers

    def saved(self, path: str) -> Sampler | None:
        return self._saved.get(path)

    def remove_owned(self, session_id: str) -> None:
        """Forget the samplers of an ended session, and the weights of paths it saved or
        opened (they load from disk again when asked for)."""
        self._samplers = {
            k: v for k, v in self._samplers.items() if owner_of(v.sampler_id) != session_id
        }
        self._saved = {k: v for k, v in self._saved.items() if owner_of(v.sampler_id) != session_id}

    def owned(self, session_id: str) -> list[str]:
        """The ids of a session's samplers."""
        return [k for k in list(self._samplers) if owner_of(k) == session_id]

    def forget_path(self, path: str) -> None:
        """A saved path was deleted: later samplers cannot be created from it."""
        self._saved.pop(path, None)

    def __len__(self) -> int:
        return len(self._samplers)


def engine_args(call: SampleCall) -> dict:
    """The engine's `/v1/completions` settings for a Tinker sample request (`stop` as
    `sample_wire` reads it; Tinker's `top_k` -1, "off", is the engine's 0)."""
    args = dict(
        n=call.num_samples,
        max_tokens=call.max_tokens,
        temperature=call.temperature,
        top_p=call.top_p,
        top_k=max(call.top_k, 0),
        seed=call.seed,
        ignore_eos=not call.stop_at_eos,
    )
    if call.stop_token_ids:
        args["stop_token_ids"] = list(call.stop_token_ids)
    if call.stop_strings:
        args["stop"] = list(call.stop_strings)
    if call.prompt_logprobs or call.topk_prompt_logprobs:
        args["prompt_logprobs"] = call.topk_prompt_logprobs
    return args


def sample_response(completion, call: SampleCall) -> bytes:
    """The protobuf `SampleResponse` of an engine completion (one sequence per sample),
    with the prompt's log-probs (raw distribution, `None` first) when asked."""
    sequences = [
        SampledSequence(
            tokens=sample.token_ids,
            logprobs=sample.logprobs,
            stop_reason="length" if sample.finish_reason == "length" else "stop",
        )
        for sample in completion.samples
    ]
    return encode_sample_response(
        sequences,
        completion.prompt_logprobs if call.prompt_logprobs else None,
        completion.prompt_top_logprobs if call.topk_prompt_logprobs else None,
        prompt_logprobs_last_n=call.prompt_logprobs_last_n,
    )

"""A request and its samples as the engine thread sees them.

The engine thread reads a request's settings after every token of every sample, so
everything it needs is prepared once, when the request is created on the caller's
loop: sampling settings sanitised so no value can raise in the shared batch
(`RowParams.sanitised`), the stop strings' search, the stop token ids as a set, and
one seeded generator per sample. The scheduler (scheduler.py) owns the rest of a
request's life.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from asyncgrpo.inference.engine.prompt_logprobs import PromptScores
from asyncgrpo.inference.engine.sampling import RowParams
from asyncgrpo.inference.engine.stop_strings import StopStrings
from asyncgrpo.inference.engine.types import SamplingParams

SEED_MODULUS = 2**64  # torch.Generator seeds are 64-bit: seed + i wraps instead of raising


@dataclass(eq=False)
class SampleState:
    """One of a request's `n` completions; `slot` is its decode slot while it runs."""

    request: Request
    index: int
    row: RowParams  # its sanitised sampling settings and seeded generator
    slot: int = -1
    cache_len: int = 0  # positions already in the KV cache
    tokens: list[int] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class Request:
    """A prompt, its samples, and the asyncio queue its deltas are delivered to."""

    id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    samples: list[SampleState] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the cache (chunked prefill)
    staging_slot: int = -1
    max_tokens: int = 0
    weights_epoch: int = -1  # the weights its keys and values were computed with
    stops: StopStrings | None = None
    stop_token_ids: frozenset[int] = frozenset()
    prompt_scores: PromptScores | None = None  # only when it asked for prompt log-probs

    @classmethod
    def create(
        cls, rid: str, prompt: list[int], params: SamplingParams, max_model_len: int, vocab: int
    ) -> Request:
        """A request of the running asyncio loop, with its `n` samples (seeded if asked)."""
        request = cls(rid, list(prompt), params, asyncio.get_running_loop(), asyncio.Queue())
        request.max_tokens = min(params.max_tokens, max_model_len - len(prompt))
        request.stops = StopStrings.of(params.stop)
        request.stop_token_ids = frozenset(params.stop_token_ids)
        if params.prompt_logprobs is not None:
            request.prompt_scores = PromptScores(request.prompt, params.prompt_logprobs)
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed((params.seed + i) % SEED_MODULUS)
            row = RowParams.sanitised(
                params.temperature, params.top_p, params.top_k, gen, params.top_logprobs, vocab
            )
            request.samples.append(SampleState(request, i, row))
        return request

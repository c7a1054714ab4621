"""From engine deltas to OpenAI choices: merging prompts, accumulating tokens, detokenizing.

One HTTP request may carry several prompts (`/v1/completions` with a list),
each with `n` samples; every (prompt, sample) pair is one choice, numbered
`prompt_index * n + sample_index` as vLLM does. A job checks the request (the
sequences it asks for, each prompt, the context) before it builds any choice, so
a request for a billion samples costs nothing. The engine runs each prompt as
its own request; `GenerationJob.deltas()` interleaves their token deltas. When
the consumer stops (client gone, task cancelled), the engine requests are
aborted through the engine's own generator clean-up, which frees their slots.

Text is produced incrementally and never retracted, so the concatenated stream
equals the non-streamed text: bytes of an unfinished UTF-8 character are held
back, and so is the tail that could still become a stop string (which, as in
the OpenAI API, is cut from the text; token ids keep every sampled token).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from asyncgrpo.inference.engine.types import PromptLogprobs, SamplingParams, TokenDelta
from asyncgrpo.inference.server.protocol import RequestLimits, check_context, check_sequences


class TextAssembler:
    """Incremental detokenizer with stop-string hold-back."""

    def __init__(self, tokenizer, stops: list[str], skip_special_tokens=True, include_stop=False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # released so far
        self._pending = ""  # decoded, not yet released
        self._prefix = 0  # ids[_prefix:_read] decode to the last released piece
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def _release(self, upto: int) -> str:
        piece, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += piece
        return piece

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now certain."""
        self.ids.extend(token_ids)
        self._pending += self._decode_new(final=False)
        return self._release(max(0, len(self._pending) - self.holdback))

    def finish(self, token_ids: list[int], stop_reason: str | int | None) -> str:
        """Add the last tokens and flush everything, cut at the stop string that ended the sample.

        The last tokens must come here, not through `push`: `push` would release
        the start of a stop string that only these tokens complete.
        """
        self.ids.extend(token_ids)
        self._pending += self._decode_new(final=True)
        if isinstance(stop_reason, str) and stop_reason:
            at = self._pending.find(stop_reason)
            if at >= 0:
                end = at + len(stop_reason) if self.include_stop else at
                self._pending = self._pending[:end]
        return self._release(len(self._pending))


@dataclass
class Choice:
    """Everything generated so far for one choice."""

    index: int
    prompt_index: int
    text: TextAssembler
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them

    def add(self, delta: TokenDelta, incremental: bool = True) -> str:
        """Record a delta; return its new text (only at the end unless `incremental`)."""
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.versions += delta.versions
        self.top_logprobs += delta.top_logprobs or [[] for _ in delta.token_ids]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is None:
            return self.text.push(delta.token_ids) if incremental else ""
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        # not incremental: one decode per choice instead of two per token
        return self.text.finish(
            delta.token_ids if incremental else self.token_ids, delta.stop_reason
        )


class GenerationJob:
    """The prompts of one HTTP request, run on the engine as one engine request each.

    `clamp_to_context`: a `max_tokens` beyond the context is cut to fit (a default
    the client did not ask for); otherwise such a request is refused, as in vLLM.
    """

    def __init__(
        self,
        engine,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        id_prefix: str = "cmpl",
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        clamp_to_context: bool = False,
    ):
        self.engine = engine
        self.prompts = prompts
        self.params = params
        self._check(clamp_to_context)  # before one object per choice exists
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.choices = {
            p * params.n + i: Choice(
                p * params.n + i,
                p,
                TextAssembler(engine.tokenizer, params.stop, skip_special_tokens, include_stop),
            )
            for p in range(len(prompts))
            for i in range(params.n)
        }

    def _check(self, clamp_to_context: bool) -> None:
        """Refuse bad requests before any response starts (the engine checks again)."""
        check_sequences(len(self.prompts), self.params.n, RequestLimits.of(self.engine))
        for prompt in self.prompts:
            self.engine.check_request(prompt, self.params)
            if not clamp_to_context:
                check_context(len(prompt), self.params.max_tokens, self.engine.max_model_len)

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    async def deltas(
        self, incremental: bool = True
    ) -> AsyncIterator[tuple[Choice, TokenDelta, str]]:
        """(choice, delta, new text) for every delta of every prompt, as they arrive."""
        streams = [
            self.engine.generate(prompt, self.params, request_id=f"{self.id}-{p}")
            for p, prompt in enumerate(self.prompts)
        ]
        async with aclosing(_merge(streams)) as merged:
            async for p, delta in merged:
                choice = self.choices[p * self.params.n + delta.index]
                yield choice, delta, choice.add(delta, incremental)

    async def run(self) -> list[Choice]:
        """Generate to the end; text is decoded once per choice."""
        async with aclosing(self.deltas(incremental=False)) as deltas:
            async for _ in deltas:
                pass
        return [self.choices[i] for i in sorted(self.choices)]


async def _merge(streams: list) -> AsyncIterator[tuple[int, TokenDelta]]:
    """Interleave async generators; an error in one ends all; closing this closes all.

    Every generator is closed explicitly (`aclosing`): an `async for` left early
    does not close its iterator, and the engine frees a request's slots only when
    its generator is closed.
    """
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, finished))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""What the embedded engine computes each step: continuous batching on the engine thread.

`Engine` (engine.py) is the front end other threads talk to; this module holds the
scheduling state it drives. It runs on the engine thread, between the commands the
front end drains, so no lock guards it; the front end only registers new requests in
`live`, reads it, and sets `weight_version` (single dict and attribute operations).

A step prefills the prompt chunks that `PrefillQueue` (prefill.py) chooses in one
batched forward (admission, prefix-cache hits copied rather than computed, prompts
longer than a chunk over several steps in a staging slot; prompt log-probs scored
from the same forward, prompt_logprobs.py), then decodes one token
for every running sample. Samples leave the batch the moment they finish, and the last one
moves into the freed slot, so decode slots stay 0..B-1; before each decode, rows are
swapped so that those of one attention key length sit together (`group_by_key_length`).
The `n` samples of a request
share its prefill and copy its keys and values. Every token is stamped with the weight
version that sampled it, and deltas go back to each consumer's own asyncio loop.

One request must never fail the others in its batch. Its sampling settings are
sanitised once, when it is created (request.py), and if sampling a batch still
raises, each request's rows are sampled alone: those that raise fail with an
`RequestError`, the rest continue with the tokens of that second draw. A failing
forward pass has no one culprit; the engine fails the whole batch then (engine.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.attention import decode_key_length
from asyncgrpo.inference.engine.prefill import PrefillQueue, Row
from asyncgrpo.inference.engine.prefix_cache import PrefixCache
from asyncgrpo.inference.engine.request import Request, SampleState
from asyncgrpo.inference.engine.runner import ModelRunner
from asyncgrpo.inference.engine.sampling import NonFiniteLogits, sample
from asyncgrpo.inference.engine.types import RequestError, TokenDelta

logger = logging.getLogger(__name__)

Outbox = dict[Request, list[TokenDelta]]


class Scheduler:
    """Waiting, prefilling and running requests, and the step that advances them."""

    def __init__(
        self,
        config: EmbeddedEngineConfig,
        runner: ModelRunner,
        prefix_cache: PrefixCache,
        tokenizer,
        eos_token_ids: set[int],
    ):
        self.config = config
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.prefill = PrefillQueue(config, prefix_cache)  # waiting and staged requests
        self.running: list[SampleState] = []  # index == decode slot
        self.live: dict[str, Request] = {}  # every request not yet finished, by id
        self.weight_version = 0  # stamped on every sampled token
        self.weights_epoch = 0  # bumped by every weight update
        self.generated_tokens = 0
        self._prefilling: list[Request] = []  # the requests of the prefill forward running

    @property
    def waiting(self) -> deque[Request]:
        return self.prefill.waiting

    @property
    def staging(self) -> list[Request]:
        """Admitted requests whose prefill spans several steps."""
        return self.prefill.staging

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens admitted."""
        return self.prefill.prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens admitted that were read from the prefix cache."""
        return self.prefill.cached_prompt_tokens

    @property
    def busy(self) -> bool:
        """True while some admitted request is still prefilling or decoding."""
        return bool(self.running or self.staging)

    def has_work(self, admit: bool) -> bool:
        return bool(self.running or self.staging or (admit and self.waiting))

    def add(self, request: Request) -> None:
        self.prefill.waiting.append(request)

    def weights_changed(self, version: int | None) -> None:
        """Forget keys and values of the old weights; restamp if given a version."""
        self.prefix_cache.clear()  # cached keys and values belong to the old weights
        self.weights_epoch += 1
        if version is not None:
            self.weight_version = int(version)

    def step(self, admit: bool) -> None:
        """One prefill forward (admitting waiting requests if `admit`), then one decode."""
        outbox: Outbox = {}
        rows = self.prefill.plan(
            admit=admit, running=len(self.running), weights_epoch=self.weights_epoch
        )
        # admitted directly, they are in no queue until their samples start: a failing
        # forward must still reach them (fail_all)
        self._prefilling = [request for request, _, _, _ in rows]
        if rows:
            self._run_prefill(rows, outbox)
        self._prefilling = []
        if self.running:
            self._decode(outbox)
        _emit(outbox)

    # ---- prefill -------------------------------------------------------------

    def _run_prefill(self, rows: list[Row], outbox: Outbox) -> None:
        """One forward over every row; prompts that are complete start their samples."""
        logits = self._prefill_forward(rows)  # (R, V): each row's last position
        direct = [(i, row) for i, row in enumerate(rows) if row[0].staging_slot < 0]
        staged = [(i, row) for i, row in enumerate(rows) if row[0].staging_slot >= 0]
        for i, (request, slot, _, end) in direct:
            self.prefix_cache.store(request.prompt, slot, end)
            self._start_samples(request, slot, logits[i], outbox)
        for i, (request, slot, _, end) in staged:
            if not self.prefill.advance(request, end):
                continue  # more chunks next step
            if request.weights_epoch == self.weights_epoch:
                self.prefix_cache.store(request.prompt, slot, end)
            self._start_samples(request, slot, logits[i], outbox)

    def _prefill_forward(self, rows: list[Row]) -> torch.Tensor:
        """The prefill forward; rows of requests that want prompt log-probs are scored."""
        args = (
            [slot for _, slot, _, _ in rows],
            [r.prompt[s:e] for r, _, s, e in rows],
            [s for _, _, s, _ in rows],
        )
        if all(r.prompt_scores is None for r, _, _, _ in rows):
            return self.runner.prefill(*args)
        logits, hidden = self.runner.prefill_states(*args)  # (R, V), (R, T, hidden)
        for i, (request, _, start, end) in enumerate(rows):
            if request.prompt_scores is not None:
                request.prompt_scores.add_chunk(self.runner.logits, hidden[i, : end - start], start)
        return logits

    def _start_samples(self, request: Request, source_slot: int, logits, outbox: Outbox) -> None:
        """Place a prefilled request's samples in decode slots and sample their first tokens."""
        length = len(request.prompt)
        for sample_ in request.samples:
            sample_.slot = len(self.running)
            sample_.cache_len = length
            self.runner.copy_slot(source_slot, sample_.slot, length)
            self.running.append(sample_)
        expanded = logits.unsqueeze(0).expand(len(request.samples), -1)  # (n, V)
        self._sample(list(request.samples), expanded, outbox)

    # ---- decode and sampling -------------------------------------------------

    def _decode(self, outbox: Outbox) -> None:
        group_by_key_length(self.running, self.runner)
        running = self.running
        tokens = torch.tensor([s.tokens[-1] for s in running])  # (B,)
        positions = torch.tensor([s.cache_len for s in running])  # (B,)
        logits = self.runner.decode(tokens, positions)  # (B, V)
        for s in running:
            s.cache_len += 1
        self._sample(list(running), logits, outbox)

    def _sample(self, samples: list[SampleState], logits: torch.Tensor, outbox: Outbox) -> None:
        """Draw the next token of every sample (logits: (B, V), row j for samples[j])."""
        try:
            out = sample(logits, [s.row for s in samples])
        except Exception:
            logger.exception("sampling %d rows failed; sampling each request alone", len(samples))
            self._sample_each_request(samples, logits, outbox)
            return
        self._record(samples, out, outbox)

    def _sample_each_request(self, samples: list[SampleState], logits, outbox: Outbox) -> None:
        """Sample each request's rows alone; fail only the requests whose rows raise.

        Sampling checks settings and logits before it draws from any seeded generator,
        so the first, failed draw leaves the surviving requests' seeded streams intact.
        """
        rows_of: dict[Request, list[int]] = {}
        for j, s in enumerate(samples):
            rows_of.setdefault(s.request, []).append(j)
        for request, rows in rows_of.items():
            mine = [samples[j] for j in rows]
            try:
                out = sample(logits[rows], [s.row for s in mine])
            except Exception as exc:
                outbox.pop(request, None)
                self.fail_request(request, _sampling_error(request, exc))
                continue
            self._record(mine, out, outbox)

    def _record(self, samples: list[SampleState], out, outbox: Outbox) -> None:
        finished = []
        version = self.weight_version
        for j, s in enumerate(samples):
            token = out.tokens[j]
            s.tokens.append(token)
            self.generated_tokens += 1
            reason, stop_reason = _finish_reason(s, token, self.eos_token_ids, self.tokenizer)
            top = [out.top_logprobs[j]] if out.top_logprobs[j] is not None else None
            delta = TokenDelta(
                s.index, [token], [out.logprobs[j]], [version], top, reason, stop_reason
            )
            if len(s.tokens) == 1 and s.request.prompt_scores is not None:
                delta.prompt_logprobs = s.request.prompt_scores.result()
            outbox.setdefault(s.request, []).append(delta)
            if reason is not None:
                finished.append(s)
                if reason == "stop" and len(s.request.samples) == 1:
                    self._cache_conversation(s)
        self._remove_samples(finished)

    def _cache_conversation(self, s: SampleState) -> None:
        """Keep a finished turn's keys and values: an agent's next prompt starts with them.

        Only single-sample requests that stopped by themselves (a turn, not a truncated
        or grouped completion), and only if no weight update happened since their prefill.
        """
        if s.request.weights_epoch == self.weights_epoch and s.slot >= 0:
            self.prefix_cache.store(s.request.prompt + s.tokens, s.slot, s.cache_len)

    # ---- leaving the batch ---------------------------------------------------

    def _remove_samples(self, samples: list[SampleState]) -> None:
        """Drop samples from the running batch, keeping decode slots compact (0..B-1)."""
        for s in sorted(samples, key=lambda x: x.slot, reverse=True):
            s.done = True
            if s.slot < 0 or s.slot >= len(self.running) or self.running[s.slot] is not s:
                continue
            last = self.running.pop()
            if last is not s:
                self.runner.copy_slot(last.slot, s.slot, last.cache_len)
                last.slot = s.slot
                self.running[s.slot] = last
            s.slot = -1
        for request in {s.request for s in samples}:
            if all(x.done for x in request.samples):
                self.live.pop(request.id, None)

    def finish_request(self, request: Request, reason: str) -> None:
        """End every unfinished sample of a request now (abort), sending a final delta."""
        open_samples = self._drop(request)
        deltas = [TokenDelta(s.index, [], [], [], None, reason) for s in open_samples]
        if deltas:
            _emit({request: deltas})

    def fail_request(self, request: Request, exc: Exception) -> None:
        """Raise `exc` in one request's consumer and drop it; the rest of the batch goes on."""
        self._drop(request)
        _raise_in_consumer(request, exc)

    def _drop(self, request: Request) -> list[SampleState]:
        """Take a request out of every queue and the batch; its samples that were open."""
        self.prefill.remove(request)
        open_samples = [s for s in request.samples if not s.done]
        self._remove_samples(open_samples)
        for s in open_samples:
            s.done = True
        self.live.pop(request.id, None)
        return open_samples

    def _all_requests(self) -> list[Request]:
        requests = self.prefill.requests() + self._prefilling + [s.request for s in self.running]
        return list(dict.fromkeys(requests))

    def abort_all(self) -> None:
        """Finish every request with its partial output and finish_reason "abort"."""
        for request in self._all_requests():
            self.finish_request(request, "abort")

    def fail_all(self, exc: Exception) -> None:
        """Raise `exc` in every request's consumer and drop all scheduling state."""
        for request in self._all_requests():
            for s in request.samples:
                s.done = True
            self.live.pop(request.id, None)
            _raise_in_consumer(request, exc)
        self.prefill.clear()
        self._prefilling = []
        self.running.clear()


def _sampling_error(request: Request, exc: Exception) -> RequestError:
    """What the consumer of a request whose rows could not be sampled is told."""
    if isinstance(exc, NonFiniteLogits):  # the forward pass, not the request, is at fault
        return RequestError("the model's logits for this request are not finite (NaN or inf)", 500)
    p = request.params
    settings = f"temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}, seed={p.seed}"
    return RequestError(f"sampling failed for this request ({settings}): {exc}", 400)


def _finish_reason(s: SampleState, token: int, eos_token_ids: set[int], tokenizer):
    """(finish_reason, stop_reason) after `token`; (None, None) while the sample goes on."""
    request = s.request
    if token in request.stop_token_ids:
        return "stop", token
    if not request.params.ignore_eos and token in eos_token_ids:
        return "stop", None
    if request.stops is not None:
        hit = request.stops.match(tokenizer, s.tokens)
        if hit is not None:
            return "stop", hit
    if len(s.tokens) >= request.max_tokens:
        return "length", None
    return None, None


def _raise_in_consumer(request: Request, exc: Exception) -> None:
    try:
        request.loop.call_soon_threadsafe(request.queue.put_nowait, exc)
    except RuntimeError:  # the consumer's loop is closed
        pass


def _emit(outbox: Outbox) -> None:
    """Hand deltas to their consumers: one thread-safe callback per asyncio loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for request, deltas in outbox.items():
        by_loop.setdefault(request.loop, []).append((request.queue, deltas))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the consumer's loop is closed
            pass


def _deliver(items) -> None:
    for q, deltas in items:
        q.put_nowait(deltas)


def group_by_key_length(running: list[SampleState], runner: ModelRunner) -> None:
    """Keep the decode rows of one attention key length in consecutive slots, longest
    first: attention then makes one call per length over exactly its rows, instead of
    computing interleaved rows once per length and keeping a share (attention.py).

    A row whose keys grow into the next block, or a row moved into a finished one's slot,
    is swapped with the row holding its place (the swap copies both caches, ~1 ms for
    SmolLM2 at 128 positions): about one swap per row every 64 tokens.
    """
    keys = [decode_key_length(s.cache_len + 1, runner.max_model_len) for s in running]
    target = sorted(keys, reverse=True)
    for i, want in enumerate(target):
        if keys[i] == want:
            continue
        # a misplaced row of the length wanted here: one that wants row i's length if any
        candidates = [j for j in range(i + 1, len(keys)) if keys[j] == want != target[j]]
        j = next((j for j in candidates if target[j] == keys[i]), candidates[0])
        a, b = running[i], running[j]
        runner.swap_slots(i, j, max(a.cache_len, b.cache_len))
        running[i], running[j] = b, a
        a.slot, b.slot = j, i
        keys[i], keys[j] = keys[j], keys[i]

"""The embedded inference engine: continuous batching on a background thread.

Requests join the running batch between decode steps and leave as soon as they
finish, so short completions never wait for long ones (worth ≈2.7× over padded
`generate()` on GRPO-shaped lengths). Prompts are prefilled in chunks, batched
across requests; the `n` samples of a request share one prefill and copy its
keys and values. Every sampled token is stamped with the weight version that
produced it.

Threading model: one engine thread owns the model, the KV cache and all
scheduling state. Everything else (HTTP handlers, weight updates, pauses,
aborts) talks to it through a command queue and receives results on its own
asyncio loop, so a weight swap can only happen between two decode steps and
never tears a forward in half.

Pause modes follow vLLM: `keep` freezes in-flight requests (they continue after
`resume`, their later tokens carrying the new version), `abort` ends them with
their partial output, `wait` stops admitting and returns once the running ones
finish.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import torch

from asyncgrpo.engine.prefix_cache import BLOCK as PREFIX_BLOCK
from asyncgrpo.engine.prefix_cache import PrefixCache
from asyncgrpo.engine.runner import ModelRunner
from asyncgrpo.engine.sampling import RowParams, sample
from asyncgrpo.engine.types import EngineError, PauseMode, SamplingParams, TokenDelta
from asyncgrpo.hardware import cpu_has_native_bf16

logger = logging.getLogger(__name__)

STAGING_SLOTS = 2  # extra cache slots for prompts whose prefill spans several steps


@dataclass
class EngineConfig:
    """Settings of the embedded engine."""

    model: str
    """Local Hugging Face model directory (see `asyncgrpo.models.resolve_model`)."""
    dtype: str = "bfloat16"
    """Weight precision: "bfloat16" or "float32". Weights are rounded to this dtype."""
    compute_dtype: str = "auto"
    """Arithmetic precision. "auto" uses bf16 where the CPU has native bf16 instructions and
    fp32 otherwise (bf16 matmuls are emulated, ≈3× slower, on AVX2-only CPUs); a bf16
    model computed in fp32 samples from the same weights with less rounding."""
    max_num_seqs: int = 64
    """KV-cache slots: how many sequences decode together."""
    max_model_len: int | None = None
    """Context limit (prompt + completion); default min(model limit, 4096)."""
    num_threads: int | None = None
    """torch intra-op threads for this process (default: torch's choice)."""
    seed: int = 0
    """Seed for requests that do not pass their own."""
    prefill_chunk_size: int = 512
    """Longest prompt piece prefilled in one step; longer prompts take several steps."""
    prefill_token_budget: int = 2048
    """Most (padded) prompt tokens prefilled in one step, across requests."""
    prefix_cache_tokens: int = 4096
    """Prompt tokens whose keys and values are kept for reuse by later prompts with the
    same prefix (system prompts, multi-turn conversations); 0 turns the cache off.
    Costs `prefix_cache_tokens` positions of KV memory."""


@dataclass(eq=False)
class _Sample:
    request: _Request
    index: int
    generator: torch.Generator | None
    slot: int = -1
    cache_len: int = 0  # positions already in the KV cache
    tokens: list[int] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    samples: list[_Sample] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already in the cache (chunked prefill)
    staging_slot: int = -1
    max_tokens: int = 0
    weights_epoch: int = -1  # the weights its keys and values were computed with


class Engine:
    """Continuous-batching generation engine over a transformers causal LM."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.dtype not in ("bfloat16", "float32"):
            raise EngineError(f"dtype must be bfloat16 or float32, got {config.dtype!r}", 500)
        self.config = config
        self.dtype = getattr(torch, config.dtype)
        compute = config.compute_dtype
        if compute == "auto":
            compute = config.dtype if cpu_has_native_bf16() else "float32"
        self.compute_dtype = getattr(torch, compute)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=self.dtype)
        model = model.to(self.compute_dtype).eval()  # bf16 values are exact in fp32
        model.requires_grad_(False)
        self.model = model
        limit = int(getattr(model.config, "max_position_embeddings", 4096) or 4096)
        if config.max_model_len and config.max_model_len > limit:
            raise EngineError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}",
                500,
            )
        self.max_model_len = int(config.max_model_len or min(limit, 4096))
        self.model_name = config.model
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = self._eos_ids(model)
        self.runner = ModelRunner(model, config.max_num_seqs + STAGING_SLOTS, self.max_model_len)
        self.prefix_cache = PrefixCache(self.runner, config.prefix_cache_tokens)
        self._weights_epoch = 0  # bumped by every weight update
        self.prompt_tokens = 0  # prompt tokens admitted
        self.cached_prompt_tokens = 0  # of which read from the prefix cache
        self._params = dict(model.state_dict(keep_vars=True))
        self.weight_version = 0
        self._paused: PauseMode | None = None
        self._pause_waiters: list[Callable[[], None]] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._waiting: deque[_Request] = deque()
        self._staging: list[_Request] = []
        self._running: list[_Sample] = []
        self._live: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self.busy_seconds = 0.0
        self.generated_tokens = 0

    def _eos_ids(self, model) -> set[int]:
        ids: set[int] = set()
        for source in (model.generation_config, model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="asyncgrpo-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def is_alive(self) -> bool:
        """True while the engine thread runs (False before start and after a crash)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_paused(self) -> bool:
        return self._paused is not None

    def stats(self) -> dict:
        return {
            "running": len(self._running),
            "prefilling": len(self._staging),
            "waiting": len(self._waiting),
            "paused": self._paused.value if self._paused else None,
            "weight_version": self.weight_version,
            "kv_capacity": self.runner.capacity,
            "busy_seconds": round(self.busy_seconds, 3),
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }

    # ---- public API (asyncio side) -------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenDelta]:
        """Stream the deltas of `params.n` samples continuing `prompt_ids`."""
        request = self._make_request(prompt_ids, params, request_id)
        self._call(lambda: self._waiting.append(request))
        finished = 0
        try:
            while finished < params.n:
                item = await request.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    finished += delta.finish_reason is not None
                    yield delta
        finally:
            if finished < params.n:
                self.abort(request.id)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise the EngineError `generate` would raise for this request, without running it.

        The server calls it for every prompt before a response starts, so a bad
        request is a clean 4xx and never a half-written stream.
        """
        if not self.is_alive():
            raise EngineError("the engine is not running", 503)
        params.validate()
        if not prompt_ids:
            raise EngineError("prompt is empty")
        if len(prompt_ids) + 1 > self.max_model_len:
            raise EngineError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len} "
                "(prompt + at least one generated token must fit)"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise EngineError(f"prompt token ids must be in [0, {self.vocab_size})")
        if params.n > self.config.max_num_seqs:
            raise EngineError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")

    def _make_request(self, prompt_ids, params: SamplingParams, request_id) -> _Request:
        self.check_request(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._live:
            raise EngineError(f"request id {rid!r} is already running", 409)
        request = _Request(
            rid, list(prompt_ids), params, asyncio.get_running_loop(), asyncio.Queue()
        )
        request.max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed + i)
            request.samples.append(_Sample(request, i, gen))
        self._live[rid] = request
        return request

    def abort(self, request_id: str) -> bool:
        request = self._live.get(request_id)
        if request is None:
            return False
        self._call(lambda: self._finish_request(request, "abort"))
        return True

    def abort_all(self) -> int:
        count = len(self._live)
        self._call(self._abort_everything)
        return count

    async def pause(self, mode: PauseMode) -> None:
        mode = PauseMode(mode)
        self._require_alive()
        done = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def resolve():
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        def command():
            self._paused = mode
            if mode is PauseMode.ABORT:
                self._abort_everything()
            if mode is PauseMode.WAIT and (self._running or self._staging):
                self._pause_waiters.append(resolve)
            else:
                resolve()

        self._call(command)
        await done

    async def resume(self) -> None:
        await self._run_on_engine(lambda: setattr(self, "_paused", None))

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Copy tensors (state_dict names) into the model between two decode steps.

        With `version`, the version stamp changes in the same engine command as
        the weights, so no token is ever stamped with a version it was not
        sampled by (even when the engine is not paused).
        """
        staged = list(named_tensors)
        for name, tensor in staged:
            target = self._params.get(name)
            if target is None:
                raise EngineError(f"unknown parameter '{name}'")
            if tuple(target.shape) != tuple(tensor.shape):
                raise EngineError(
                    f"shape mismatch for '{name}': got {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )

        def copy_all():
            with torch.no_grad():
                for name, tensor in staged:
                    # round to the weight dtype first: a bf16 model stays a bf16 model
                    # even when the engine computes in fp32
                    self._params[name].copy_(tensor.to(self.dtype))
            self.runner.weights_changed()
            self.prefix_cache.clear()  # cached keys and values belong to the old weights
            self._weights_epoch += 1
            if version is not None:
                self.weight_version = int(version)

        await self._run_on_engine(copy_all)

    def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)

    # ---- plumbing between threads ----------------------------------------------

    def _require_alive(self) -> None:
        # a command queued to a dead engine thread would never run: fail fast instead
        if not self.is_alive():
            raise EngineError("the engine is not running", 503)

    def _call(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    async def _run_on_engine(self, fn: Callable[[], object]):
        self._require_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def command():
            try:
                result = fn()
            except BaseException as exc:  # delivered to the caller, never kills the engine
                loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._call(command)
        return await future

    def _emit(self, outbox: dict[_Request, list[TokenDelta]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request, deltas in outbox.items():
            by_loop.setdefault(request.loop, []).append((request.queue, deltas))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumer's loop is closed
                pass

    # ---- engine thread ---------------------------------------------------------

    def _loop(self) -> None:
        # Cache tensors are created and updated only here, all as inference tensors.
        with torch.inference_mode():
            self._serve_forever()
        self._fail_everything(EngineError("engine shut down", 503))

    def _serve_forever(self) -> None:
        while not self._stop:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                except Exception:
                    logger.exception("engine command failed")
            if self._pause_waiters and not (self._running or self._staging):
                for resolve in self._pause_waiters:
                    resolve()
                self._pause_waiters.clear()
            if not self._has_work():
                if not self._live and self.runner.capacity > 1024:
                    self.runner.release_memory()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                self._step()
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in it")
                self._fail_everything(exc)
            self.busy_seconds += time.perf_counter() - start

    def _has_work(self) -> bool:
        if self._paused is PauseMode.KEEP or self._paused is PauseMode.ABORT:
            return False
        admitting = self._paused is None and self._waiting
        return bool(self._running or self._staging or admitting)

    def _step(self) -> None:
        outbox: dict[_Request, list[TokenDelta]] = {}
        self._prefill(outbox)
        if self._running:
            self._decode(outbox)
        self._emit(outbox)

    def _free_decode_slots(self) -> int:
        reserved = sum(r.params.n for r in self._staging)
        return self.config.max_num_seqs - len(self._running) - reserved

    def _prefill(self, outbox) -> None:
        """Admit waiting requests and run one batched prefill forward."""
        chunk_size = self.config.prefill_chunk_size
        budget = self.config.prefill_token_budget
        rows: list[tuple[_Request, int, int, int]] = []  # (request, slot, start, end)
        for request in self._staging:
            end = min(len(request.prompt), request.prefilled + chunk_size)
            rows.append((request, request.staging_slot, request.prefilled, end))
        next_slot = len(self._running)
        free = self._free_decode_slots()
        pending: set = set()  # prefix blocks this step's rows will compute
        while self._waiting and self._paused is None:
            request = self._waiting[0]
            n, length = request.params.n, len(request.prompt)
            if n > free:
                break
            # the last prompt token is always computed: its logits start the completion
            hits, missing = self.prefix_cache.lookup(request.prompt, length - 1)
            if missing is not None and missing in pending:
                break  # a row of this step computes the same blocks: reuse them next step
            cached = len(hits) * PREFIX_BLOCK
            remaining = length - cached
            widest = max([remaining] + [e - s for _, _, s, e in rows])
            if rows and widest * (len(rows) + 1) > budget:
                break
            if remaining <= chunk_size:
                slot = next_slot
                rows.append((request, slot, cached, length))
                next_slot += n
            else:
                used = {r.staging_slot for r in self._staging}
                spare = [s for s in self._staging_slot_ids() if s not in used]
                if not spare:
                    break
                slot = request.staging_slot = spare[0]
                request.prefilled = cached
                self._staging.append(request)
                rows.append((request, slot, cached, cached + chunk_size))
            self.prefix_cache.load(hits, slot)
            request.weights_epoch = self._weights_epoch
            self.prompt_tokens += length
            self.cached_prompt_tokens += cached
            if missing is not None:
                pending.add(missing)
            free -= n
            self._waiting.popleft()
        if not rows:
            return
        logits = self.runner.prefill(
            [slot for _, slot, _, _ in rows],
            [r.prompt[s:e] for r, _, s, e in rows],
            [s for _, _, s, _ in rows],
        )
        direct = [(i, row) for i, row in enumerate(rows) if row[0].staging_slot < 0]
        staged = [(i, row) for i, row in enumerate(rows) if row[0].staging_slot >= 0]
        for i, (request, slot, _, end) in direct:
            self.prefix_cache.store(request.prompt, slot, end)
            self._start_samples(request, slot, logits[i], outbox)
        for i, (request, slot, _, end) in staged:
            request.prefilled = end
            if end == len(request.prompt):
                if request.weights_epoch == self._weights_epoch:
                    self.prefix_cache.store(request.prompt, slot, end)
                self._staging.remove(request)
                request.staging_slot = -1
                self._start_samples(request, slot, logits[i], outbox)

    def _staging_slot_ids(self) -> range:
        base = self.config.max_num_seqs
        return range(base, base + STAGING_SLOTS)

    def _start_samples(self, request: _Request, source_slot: int, logits, outbox) -> None:
        """Place a prefilled request's samples in decode slots and sample their first tokens."""
        length = len(request.prompt)
        for sample_ in request.samples:
            sample_.slot = len(self._running)
            sample_.cache_len = length
            self.runner.copy_slot(source_slot, sample_.slot, length)
            self._running.append(sample_)
        rows = request.samples
        out = sample(logits.unsqueeze(0).expand(len(rows), -1), [self._row(s) for s in rows])
        self._record(rows, out, outbox)

    def _row(self, s: _Sample) -> RowParams:
        p = s.request.params
        return RowParams(p.temperature, p.top_p, p.top_k, s.generator, p.top_logprobs)

    def _decode(self, outbox) -> None:
        running = self._running
        tokens = torch.tensor([s.tokens[-1] for s in running])
        positions = torch.tensor([s.cache_len for s in running])
        logits = self.runner.decode(tokens, positions)
        for s in running:
            s.cache_len += 1
        self._record(list(running), sample(logits, [self._row(s) for s in running]), outbox)

    def _record(self, samples: list[_Sample], out, outbox) -> None:
        finished = []
        version = self.weight_version
        for j, s in enumerate(samples):
            token = out.tokens[j]
            s.tokens.append(token)
            self.generated_tokens += 1
            reason, stop_reason = self._finish_reason(s, token)
            top = [out.top_logprobs[j]] if out.top_logprobs[j] is not None else None
            delta = TokenDelta(
                s.index, [token], [out.logprobs[j]], [version], top, reason, stop_reason
            )
            outbox.setdefault(s.request, []).append(delta)
            if reason is not None:
                finished.append(s)
                if reason == "stop" and len(s.request.samples) == 1:
                    self._cache_conversation(s)
        self._remove_samples(finished)

    def _cache_conversation(self, s: _Sample) -> None:
        """Keep a finished turn's keys and values: an agent's next prompt starts with them.

        Only single-sample requests that stopped by themselves (a turn, not a truncated
        or grouped completion), and only if no weight update happened since their prefill.
        """
        if s.request.weights_epoch == self._weights_epoch and s.slot >= 0:
            self.prefix_cache.store(s.request.prompt + s.tokens, s.slot, s.cache_len)

    def _finish_reason(self, s: _Sample, token: int):
        p = s.request.params
        if token in p.stop_token_ids:
            return "stop", token
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if p.stop:
            hit = self._stop_string(s.tokens, p.stop)
            if hit is not None:
                return "stop", hit
        if len(s.tokens) >= s.request.max_tokens:
            return "length", None
        return None, None

    def _stop_string(self, tokens: list[int], stops: list[str]) -> str | None:
        window = max(len(x) for x in stops) + 2
        text = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        for stop in stops:
            if stop and stop in text:
                return stop
        return None

    def _remove_samples(self, samples: list[_Sample]) -> None:
        """Drop samples from the running batch, keeping decode slots compact (0..B-1)."""
        for s in sorted(samples, key=lambda x: x.slot, reverse=True):
            s.done = True
            if s.slot < 0 or s.slot >= len(self._running) or self._running[s.slot] is not s:
                continue
            last = self._running.pop()
            if last is not s:
                self.runner.copy_slot(last.slot, s.slot, last.cache_len)
                last.slot = s.slot
                self._running[s.slot] = last
            s.slot = -1
        for request in {s.request for s in samples}:
            if all(x.done for x in request.samples):
                self._live.pop(request.id, None)

    def _finish_request(self, request: _Request, reason: str) -> None:
        """End every unfinished sample of a request now (abort), sending a final delta."""
        if request in self._waiting:
            self._waiting.remove(request)
        if request in self._staging:
            self._staging.remove(request)
        open_samples = [s for s in request.samples if not s.done]
        self._remove_samples(open_samples)
        for s in open_samples:
            s.done = True
        self._live.pop(request.id, None)
        deltas = [TokenDelta(s.index, [], [], [], None, reason) for s in open_samples]
        if deltas:
            self._emit({request: deltas})

    def _abort_everything(self) -> None:
        requests = list(self._waiting) + list(self._staging) + [s.request for s in self._running]
        for request in dict.fromkeys(requests):
            self._finish_request(request, "abort")
        if self._pause_waiters:
            for resolve in self._pause_waiters:
                resolve()
            self._pause_waiters.clear()

    def _fail_everything(self, exc: Exception) -> None:
        requests = list(self._waiting) + list(self._staging) + [s.request for s in self._running]
        for request in dict.fromkeys(requests):
            for s in request.samples:
                s.done = True
            self._live.pop(request.id, None)
            try:
                request.loop.call_soon_threadsafe(request.queue.put_nowait, exc)
            except RuntimeError:
                pass
        self._waiting.clear()
        self._staging.clear()
        self._running.clear()


def _deliver(items) -> None:
    for q, deltas in items:
        q.put_nowait(deltas)

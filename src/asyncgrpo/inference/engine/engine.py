"""The embedded inference engine: continuous batching on a background thread.

Requests join the running batch between decode steps and leave as soon as they
finish, so short completions never wait for long ones (worth ≈2.7× over padded
`generate()` on GRPO-shaped lengths). Prompts are prefilled in chunks, batched
across requests; the `n` samples of a request share one prefill and copy its
keys and values. Every sampled token is stamped with the weight version that
produced it. What each step computes is decided by the `Scheduler`
(scheduler.py); this module is the front end around it.

Threading model: one engine thread owns the model, the KV cache and the
scheduler. Everything else (HTTP handlers, weight updates, pauses, aborts)
talks to it through a command queue and receives results on its own asyncio
loop, so a weight swap can only happen between two decode steps and never
tears a forward in half.

Device: `engine.device` resolves once to `Engine.device`; the model is loaded there and
the runner, its KV cache and the sampler compute on the model's device. On cuda
(experimental, `EmbeddedEngineConfig.device`) the cache is paged and attended with
FlexAttention: the same code the CPU runs with `kv_cache: paged, paged_attention: flex`.
A weight update copies into the parameters where they live, from tensors on any device.

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
from collections.abc import AsyncIterator, Callable, Iterable

import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.hardware import use_threads_here
from asyncgrpo.inference.adapters import (
    AdapterError,
    AdapterMerge,
    adapter_pairs,
    check_against,
    is_adapter_update,
)
from asyncgrpo.inference.core_share import BusyFlag
from asyncgrpo.inference.engine.kv_layout import build_cache
from asyncgrpo.inference.engine.loading import (
    check_update,
    context_limit,
    eos_ids,
    load_model,
    tied_names,
)
from asyncgrpo.inference.engine.request import Request
from asyncgrpo.inference.engine.runner import ModelRunner
from asyncgrpo.inference.engine.scheduler import Scheduler
from asyncgrpo.inference.engine.types import PauseMode, RequestError, SamplingParams, TokenDelta

logger = logging.getLogger(__name__)
HEAD = "lm_head.weight"  # an adapter on a head tied to the embedding unties them


class _EngineThread:
    """The engine thread and the command queue through which other threads reach it.

    The subclass's `_loop` is the thread's body: it runs the queued commands and
    returns once `_stop` is set; `_wake` is set whenever there is news for it.
    """

    def __init__(self, num_threads: int = 1) -> None:
        # the engine thread's torch threads: the process's only OpenMP pool, as a second one
        # would slow both (hardware.use_threads_here); the thread that builds it uses one
        self.num_threads = num_threads
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncgrpo-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        use_threads_here(self.num_threads)
        self._loop()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def is_alive(self) -> bool:
        """True while the engine thread runs (False before start and after a crash)."""
        return self._thread is not None and self._thread.is_alive()

    def _require_alive(self) -> None:
        # a command queued to a dead engine thread would never run: fail fast instead
        if not self.is_alive():
            raise RequestError("the engine is not running", 503)

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


class Engine(_EngineThread):
    """Continuous-batching generation engine over a transformers causal LM.

    Thread lifecycle (`start`, `shutdown`, `is_alive`) and running commands on
    the engine thread come from `_EngineThread`.
    """

    def __init__(self, config: EmbeddedEngineConfig):
        if config.model is None:
            raise RequestError("engine.model: no model directory given", 500)
        self.config = config
        self.dtype = getattr(torch, config.resolved_dtype())
        self.compute_dtype = getattr(torch, config.resolved_compute_dtype())
        self.device = device = torch.device(config.resolved_device())  # model, cache, sampler
        threads = config.num_threads or torch.get_num_threads()
        torch.set_num_threads(1)  # only the engine thread computes on several (`_EngineThread`)
        self.tokenizer, model = load_model(config.model, self.dtype, self.compute_dtype, device)
        self.model = model
        self.max_model_len = context_limit(config, model)
        self.model_name = config.model
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = eos_ids(model, self.tokenizer)
        self.runner, self.prefix_cache = build_cache(config, model, self.max_model_len)
        self.scheduler = Scheduler(
            config, self.runner, self.prefix_cache, self.tokenizer, self.eos_token_ids
        )
        self._params = dict(model.state_dict(keep_vars=True))
        self._adapters = AdapterMerge(self._params, self.dtype)
        self._paused: PauseMode | None = None
        self._pause_waiters: list[Callable[[], None]] = []
        super().__init__(threads)
        self._ids = itertools.count()
        self.busy_seconds = 0.0
        self._busy_flag = BusyFlag.from_env()  # tells a trainer on this machine (core_share)

    # ---- counters kept by the scheduler ----------------------------------------

    @property
    def weight_version(self) -> int:
        """The version stamped on every token sampled from now on."""
        return self.scheduler.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.scheduler.weight_version = version

    @property
    def generated_tokens(self) -> int:
        return self.scheduler.generated_tokens

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens admitted."""
        return self.scheduler.prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        """Admitted prompt tokens read from the prefix cache."""
        return self.scheduler.cached_prompt_tokens

    # ---- state ---------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused is not None

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "prefilling": len(self.scheduler.staging),
            "waiting": len(self.scheduler.waiting),
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
        self._call(lambda: self.scheduler.add(request))
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
        """Raise the RequestError `generate` would raise for this request, without running it.

        The server calls it for every prompt before a response starts, so a bad
        request is a clean 4xx and never a half-written stream.
        """
        if not self.is_alive():
            raise RequestError("the engine is not running", 503)
        params.validate()
        _check_prompt(prompt_ids, self.max_model_len, self.vocab_size)
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")

    def _make_request(self, prompt_ids, params: SamplingParams, request_id) -> Request:
        self.check_request(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.scheduler.live:
            raise RequestError(f"request id {rid!r} is already running", 409)
        request = Request.create(rid, prompt_ids, params, self.max_model_len, self.vocab_size)
        self.scheduler.live[rid] = request
        return request

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.live.get(request_id)
        if request is None:
            return False
        self._call(lambda: self.scheduler.finish_request(request, "abort"))
        return True

    def abort_all(self) -> int:
        count = len(self.scheduler.live)
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
            if mode is PauseMode.WAIT and self.scheduler.busy:
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

        An update whose names are all LoRA adapter tensors (`asyncgrpo.inference.adapters`) is
        merged instead: each targeted weight becomes its base value plus B @ A. With
        `version`, the version stamp changes in the same engine command as the weights,
        so no token is ever stamped with a version it was not sampled by (even when the
        engine is not paused). Everything is checked before anything is written.
        """
        staged = list(named_tensors)
        untie = False
        try:
            pairs = adapter_pairs(staged) if is_adapter_update(n for n, _ in staged) else None
            if pairs is not None:
                tied = tied_names(self._params)
                untie = HEAD in tied and any(p.base_name == HEAD for p in pairs)
                check_against(pairs, self._params, tied - {HEAD})
        except AdapterError as exc:
            raise RequestError(str(exc)) from None
        if pairs is None:
            check_update(self._params, staged)

        def write():
            if untie:
                untie_head(self.model, self._params, self.runner)
            if pairs is None:
                self._adapters.forget(name for name, _ in staged)
            writes = staged if pairs is None else self._adapters.merged(pairs)
            with torch.no_grad():
                for name, tensor in writes:
                    # round to the weight dtype first: a bf16 model stays a bf16 model
                    # even when the engine computes in fp32 (copy_ rounds the same way)
                    param = self._params[name]
                    param.copy_(tensor if param.dtype == self.dtype else tensor.to(self.dtype))
            self.runner.weights_changed([self._params[name] for name, _ in writes])
            self.scheduler.weights_changed(version)

        await self._run_on_engine(write)

    def set_weight_version(self, version: int) -> None:
        self.weight_version = int(version)

    # ---- engine thread ---------------------------------------------------------

    def _loop(self) -> None:
        # Cache tensors are created and updated only here, all as inference tensors.
        with torch.inference_mode():
            self._serve_forever()
        self.scheduler.fail_all(RequestError("engine shut down", 503))

    def _serve_forever(self) -> None:
        while not self._stop:
            if not self._commands.empty():  # a weight update copies 100s of MB: the core is
                self._busy_flag.set(True)  # ours, even when paused (core_share.py)
                _run_commands(self._commands)
            if not self.scheduler.busy:
                self._release_pause_waiters()
            if not self._has_work():
                self._busy_flag.set(False)
                if not self.scheduler.live and self.runner.capacity > 1024:
                    self.runner.release_memory()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._busy_flag.set(True)
            start = time.perf_counter()
            try:
                self.scheduler.step(admit=self._paused is None)
            except Exception as exc:
                # sampling failures are isolated per request (scheduler.py): this is a
                # forward pass or bookkeeping failure, with no one request to blame
                logger.exception("engine step failed; failing every request in it")
                self.scheduler.fail_all(exc)
            self.busy_seconds += time.perf_counter() - start

    def _has_work(self) -> bool:
        if self._paused is PauseMode.KEEP or self._paused is PauseMode.ABORT:
            return False
        return self.scheduler.has_work(admit=self._paused is None)

    def _release_pause_waiters(self) -> None:
        for resolve in self._pause_waiters:
            resolve()
        self._pause_waiters.clear()

    def _abort_everything(self) -> None:
        self.scheduler.abort_all()
        self._release_pause_waiters()


def _run_commands(commands: queue.SimpleQueue) -> None:
    """Run every queued command; one that raises is logged and never stops the engine."""
    while True:
        try:
            commands.get_nowait()()
        except queue.Empty:
            break
        except Exception:
            logger.exception("engine command failed")


def _check_prompt(prompt_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise RequestError("prompt is empty")
    if len(prompt_ids) + 1 > max_model_len:
        raise RequestError(
            f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len} "
            "(prompt + at least one generated token must fit)"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")


def untie_head(model, params: dict[str, torch.Tensor], runner: ModelRunner) -> None:
    """Give a tied LM head its own copy of the embedding, so an adapter on the head
    (Tinker's `train_unembed`) changes the output layer and leaves the input alone."""
    head = model.lm_head
    separate = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    head.weight = separate
    params[HEAD] = separate
    runner.untie_head(separate)

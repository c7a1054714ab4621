"""What `asyncgrpo tinker-serve` does behind its routes: sessions, training models, samplers.

The HTTP layer (`app.py`) decodes a request and calls one method here (or a function of
`state_ops.py` for saved states, of `sampling_ops.py` for samplers and samples). Training
work runs on one worker thread (the models share one base, so one operation at a time), in
each model's `seq_id` order (`futures.SeqOrder`); sampling runs on the engine, its own
process, so a client samples batch n+1 while batch n trains. Every submitted operation answers a
request id at once and its outcome is fetched with `futures.FutureTable.retrieve`.

Ids follow what the SDK assumes: a model created as `model_seq_id` k of session s is
`s:train:k`; a sampler is `s:sample:k`; saved sampler weights live at
`tinker://<model_id>/sampler_weights/<name>`. Everything a session created is released when
it ends (`sessions.py`): its pending futures fail, its models and samplers leave memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.base.hardware import threads_here, use_threads_here
from asyncgrpo.inference.server.request_log import note
from asyncgrpo.tinker import wire
from asyncgrpo.tinker.checkpoints import CheckpointStore
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import FutureTable, Outcome, SeqOrder
from asyncgrpo.tinker.json_wire import CreateModelCall, OptimStepCall
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.metrics import TinkerMetrics
from asyncgrpo.tinker.sampling import (
    EngineWeights,
    NamedTensors,
    SamplerRegistry,
)
from asyncgrpo.tinker.sessions import CLOSED, DEFAULT_TTL_S, EXPIRED, SessionTable, owner_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """What the server was started with: the base model's name and local directory."""

    name: str
    directory: str
    vocab_size: int
    max_length: int


class TinkerService:
    """Sessions, LoRA training models on one base, and samplers on one engine."""

    def __init__(
        self,
        served: ServedModel,
        models,
        backend,
        limits: TinkerLimits,
        base_adapter: NamedTensors,
        state_dir: Path,
        session_ttl_s: float = DEFAULT_TTL_S,
    ):
        """`models`: the training models (`training.LoraModels`); `backend`: the engine
        that samples (`asyncgrpo.inference.backend`); `base_adapter`: an adapter that leaves the
        engine at the base weights; `state_dir`: where `tinker://` paths are stored;
        `session_ttl_s`: how long a session lives without a word from its client."""
        self.served = served
        self.models = models
        self.backend = backend
        self.limits = limits
        self.futures = FutureTable()
        self.samplers = SamplerRegistry()
        self.checkpoints = CheckpointStore(state_dir)
        self.engine = EngineWeights(backend, lambda: base_adapter)
        self.sessions = SessionTable(session_ttl_s)
        self.metrics = TinkerMetrics(self)
        self._reaper: asyncio.Task | None = None
        self._order: dict[str, SeqOrder] = {}
        # model id → (version, its newest weights), which `inflight` samplers follow
        self.latest: dict[str, tuple[int, Any]] = {}
        # the trainer's thread computes on this (building) thread's count, not on whatever
        # process-wide count it would copy at its first op (hardware.use_threads_here)
        self._trainer = ThreadPoolExecutor(
            1, "tinker-train", initializer=use_threads_here, initargs=(threads_here(),)
        )

    # ---- sessions ----------------------------------------------------------------

    def create_session(self) -> dict:
        session_id = f"session-{secrets.token_hex(6)}"
        self.sessions.add(session_id)
        note(session=session_id)
        return {"type": "create_session", "session_id": session_id}

    def session(self, session_id: str):
        """The live session (`sessions.Session`), refused if ended or unknown."""
        note(session=session_id)
        return self.sessions.get(session_id)

    def heard(self, some_id: str, field_name: str) -> None:
        """A request names a model or sampler: its session's client is alive (refused if
        that session ended); both go on the request's log line."""
        note(session=owner_of(some_id), model=some_id)
        self.sessions.touch(some_id, field_name)

    def finish_session(self, session_id: str) -> None:
        """The client closed the session: it ends now (closing an ended one again is a
        no-op, as the SDK's first-wins finish reason has it)."""
        if not self.sessions.is_ended(session_id):
            self.session(session_id)
            self.end_session(session_id, CLOSED)

    def end_session(self, session_id: str, how: str) -> None:
        """End a live session (`how`: sessions.EXPIRED or CLOSED): its pending futures fail
        with why, its samplers go now, its models after the operation the trainer is
        running (on the trainer's thread, in turn). Its saved paths stay on disk."""
        if not self.sessions.end(session_id, how):
            return
        error = {"error": self.sessions.ended_message(session_id, how), "category": "user"}
        failed = self.futures.fail_owned(session_id, error)
        self.samplers.remove_owned(session_id)
        release = self._trainer.submit(self._release_models, session_id)
        release.add_done_callback(_log_failure)
        logger.info("session %s %s; %d pending operations failed", session_id, how, failed)

    def _release_models(self, session_id: str) -> None:
        """Trainer thread: the session's models leave memory (adapter, Adam state, the
        snapshot its samplers follow)."""
        owned = {*self._order, *self.latest, *self.models.models}
        for model_id in [m for m in owned if owner_of(m) == session_id]:
            self._order.pop(model_id, None)
            self.latest.pop(model_id, None)
            if model_id in self.models.models:
                self.models.remove(model_id)

    async def _expire_sessions(self) -> None:
        """End the sessions whose clients have been silent for the TTL, checked a few
        times per TTL (at most every 10 s)."""
        period = min(self.sessions.ttl_s / 4, 10.0)
        while True:
            await asyncio.sleep(period)
            for session_id in self.sessions.expired():
                try:
                    self.end_session(session_id, EXPIRED)
                except Exception:  # a bug here must not stop every later expiry
                    logger.exception("ending session %s failed", session_id)

    def resident_models(self) -> int:
        return len(self.models.models)

    def queue_depths(self) -> dict[str, int]:
        """Operations queued or running per model, in its seq_id order."""
        orders = dict(self._order)  # one copy: the trainer's thread adds and removes models
        return {model_id: order.depth for model_id, order in orders.items()}

    # ---- training models ---------------------------------------------------------

    def create_model(self, call: CreateModelCall) -> dict:
        self.session(call.session_id)  # the model belongs to a live session
        model_id = call.model_id
        if call.base_model not in (self.served.name, self.served.directory):
            raise TinkerUserError(
                "base_model", f"this server trains {self.served.name!r}, not {call.base_model!r}"
            )

        def create() -> Outcome:
            self.models.create(
                model_id,
                rank=call.rank,
                seed=call.seed,
                train_mlp=call.train_mlp,
                train_attn=call.train_attn,
                train_unembed=call.train_unembed,
            )
            self.register_model(model_id)
            return Outcome(json={"type": "create_model", "model_id": model_id})

        request_id = self.futures.submit(
            ("create", model_id), lambda: self.in_trainer(create), owner=call.session_id
        )
        note(model=model_id, request_id=request_id)
        return {"request_id": request_id, "model_id": model_id}

    def get_info(self, model_id: str) -> dict:
        self._require_model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "model_name": self.served.name,
                "tokenizer_id": self.served.directory,
                "arch": "llama",
            },
            "is_lora": True,
            "lora_rank": self.models.spec(model_id).rank,
            "model_name": self.served.name,
        }

    def forward_backward(self, call: wire.ForwardBackwardCall) -> dict:
        def run() -> Outcome:
            wire.check_datums(
                call.datums, call.loss_fn, self.served.vocab_size, self.served.max_length
            )
            name = "forward" if call.forward_only else "forward_backward"
            run = getattr(self.models, name)
            with self.metrics.timed(name):
                out = run(call.model_id, call.datums, call.loss_fn, call.loss_fn_config)
            return Outcome(proto=wire.encode_forward_backward_output(out.logprobs, out.metrics))

        return self.ordered(call.model_id, call.seq_id, run)

    def optim_step(self, call: OptimStepCall) -> dict:
        model_id = call.model_id

        def run() -> Outcome:
            with self.metrics.timed("optim_step"):
                metrics = self.models.optim_step(model_id, call.adam)
            self.publish(model_id)
            return Outcome(json={"type": "optim_step", "metrics": metrics})

        return self.ordered(model_id, call.seq_id, run)

    def fail_in_turn(self, exc: TinkerUserError) -> dict:
        """A request refused while decoding, once its seq_id is known: it fails through
        its future in turn, so the model's later operations (the client already numbered
        them) still run."""
        owner, seq_id = exc.request_key

        def refuse() -> Outcome:
            raise exc

        if owner in self._order:
            return self.ordered(owner, seq_id, refuse)
        raise exc

    # ---- plumbing ----------------------------------------------------------------

    def register_model(self, model_id: str) -> None:
        """A model just created (or loaded) in `models` takes requests: trainer thread."""
        self.publish(model_id)
        self._order[model_id] = SeqOrder()

    def publish(self, model_id: str) -> None:
        """The model's weights changed: `inflight` samplers follow. Trainer thread."""
        version = self.latest[model_id][0] + 1 if model_id in self.latest else 0
        self.latest[model_id] = (version, self.models.sampler_weights(model_id))

    def _require_model(self, model_id: str) -> None:
        self.heard(model_id, "model_id")
        if model_id not in self._order:
            raise TinkerUserError("model_id", f"unknown model {model_id!r}")

    def ordered(self, model_id: str, seq_id: int | None, work: Callable[[], Outcome]) -> dict:
        """Queue `work` behind the model's lower seq_ids; a request id at once."""
        self._require_model(model_id)
        order = self._order[model_id]

        async def run() -> Outcome:
            return await order.run(seq_id, lambda: self.in_trainer(work))

        key = (model_id, seq_id) if seq_id is not None else None
        request_id = self.futures.submit(key, run, owner=owner_of(model_id))
        note(request_id=request_id)
        return {"request_id": request_id, "model_id": model_id}

    async def retrieve(self, request_id: str, long_poll_s: float):
        """A future's outcome, or None while pending (`FutureTable.retrieve`). A poll is
        word from its session's client, and is answered within half the TTL, so that a
        client waiting on a long operation polls again before its session would expire."""
        owner = self.futures.owner(request_id)  # KeyError: unknown
        note(session=owner, request_id=request_id)
        if owner is not None:
            self.sessions.heard_from(owner)
        wait_s = min(long_poll_s, self.sessions.ttl_s / 2)
        outcome = await self.futures.retrieve(request_id, wait_s)
        if outcome is not None and outcome.error is not None:  # the client's refusal
            reason = "refused" if outcome.error.get("category") == "user" else "error"
            note(**{reason: outcome.error.get("error")})
        return outcome

    async def in_trainer(self, work: Callable[[], Outcome]) -> Outcome:
        return await asyncio.get_running_loop().run_in_executor(self._trainer, work)

    async def start(self) -> None:
        """Wait for the engine to answer; from then on, silent sessions expire."""
        await self.backend.wait_ready()
        self._reaper = asyncio.get_running_loop().create_task(self._expire_sessions())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.futures.close()
        self._trainer.shutdown(wait=True, cancel_futures=True)
        await self.backend.close()


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("releasing a session's models failed", exc_info=future.exception())

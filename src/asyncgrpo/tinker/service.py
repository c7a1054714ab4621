"""What `asyncgrpo tinker-serve` does behind its routes: sessions, training models, samplers.

The HTTP layer (`app.py`) decodes a request and calls one method here (or a function of
`session_ops.py` for sessions' starts and ends, of `state_ops.py` for saved states, of
`sampling_ops.py` for samplers and samples). Training work runs on one worker thread (the
models share one base, so one operation at a time), in each model's `seq_id` order
(`futures.SeqOrder`); sampling runs on the engine, its own process, so a client samples
batch n+1 while batch n trains. Every submitted operation answers a request id at once and
its outcome is fetched with `futures.FutureTable.retrieve`.

Ids follow what the SDK assumes: a model created as `model_seq_id` k of session s is
`s:train:k`; a sampler is `s:sample:k`; saved sampler weights live at
`tinker://<model_id>/sampler_weights/<name>`. Everything a session created is released when
it ends (`sessions.py`): its pending futures fail, its models and samplers leave memory.

With `--max-resident-models N`, models and samplers' weights beyond N wait on disk and come
back on their next use (`offload.py`, `snapshots.py`): every model operation goes through
`ordered`, which brings its model in before the operation runs.

What must outlive the process goes to the database (`store.py`) as it happens: sessions,
models, checkpoints, and every operation's outcome, so that a restarted server lists what
was saved, tells the clients of sessions that died with the process that they did, and
answers a poll for an operation of the process before (`recovery.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.base.hardware import threads_here, use_threads_here
from asyncgrpo.inference.server.request_log import note
from asyncgrpo.tinker import recovery, session_ops, wire
from asyncgrpo.tinker.checkpoints import CheckpointStore
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import FutureTable, Outcome, SeqOrder
from asyncgrpo.tinker.json_wire import CreateModelCall, OptimStepCall
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.metrics import TinkerMetrics
from asyncgrpo.tinker.offload import ModelOffload, fresh_offload_dir
from asyncgrpo.tinker.sampling import SamplerRegistry, SamplingEngine
from asyncgrpo.tinker.sessions import DEFAULT_TTL_S, SessionTable, owner_of
from asyncgrpo.tinker.snapshots import SnapshotCache
from asyncgrpo.tinker.store import TinkerStore


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
        engine: SamplingEngine,
        state_dir: Path,
        store: TinkerStore,
        session_ttl_s: float = DEFAULT_TTL_S,
        max_resident_models: int | None = None,
    ):
        """`models`: the training models (`training.LoraModels`); `backend`: the engine
        that samples (`asyncgrpo.inference.backend`); `engine`: how a sample gets its
        sampler's weights there (`sampling.EngineWeights`, `vllm_sampling.VLLMAdapters`);
        `state_dir`: where `tinker://` paths are stored; `store`: the database (closed
        with the service); `session_ttl_s`: how long a session lives without a word from
        its client; `max_resident_models`: how many training models, and how many sets of
        sampler weights, memory holds (None: all)."""
        self.served = served
        self.models = models
        self.backend = backend
        self.limits = limits
        self.store = store
        self.futures = FutureTable(journal=store, boot=store.boot)
        self.samplers = SamplerRegistry()
        self.checkpoints = CheckpointStore(state_dir)
        self.engine = engine
        self.sessions = SessionTable(session_ttl_s)
        self.metrics = TinkerMetrics(self)
        self._reaper: asyncio.Task | None = None
        self._pruner: asyncio.Task | None = None
        self._order: dict[str, SeqOrder] = {}
        offload_dir = fresh_offload_dir(state_dir)  # the service holds the state dir now
        self.offload = ModelOffload(models, offload_dir, max_resident_models, self._order)
        self.snapshots = SnapshotCache(offload_dir, max_resident_models)
        # model id → (version, its newest weights), which `inflight` samplers follow
        self.latest: dict[str, tuple[int, Any]] = {}
        # the trainer's thread computes on this (building) thread's count, not on whatever
        # process-wide count it would copy at its first op (hardware.use_threads_here)
        self._trainer = ThreadPoolExecutor(
            1, "tinker-train", initializer=use_threads_here, initargs=(threads_here(),)
        )

    # ---- sessions ----------------------------------------------------------------

    def session(self, session_id: str):
        """The live session (`sessions.Session`), refused if ended or unknown."""
        note(session=session_id)
        return self.sessions.get(session_id)

    def heard(self, some_id: str, field_name: str) -> None:
        """A request names a model or sampler: its session's client is alive (refused if
        that session ended); both go on the request's log line."""
        note(session=owner_of(some_id), model=some_id)
        self.sessions.touch(some_id, field_name)

    def resident_models(self) -> int:
        return self.models.resident_count()

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
            self.record_model(model_id, user_metadata=call.user_metadata)
            self.register_model(model_id)
            return Outcome(json={"type": "create_model", "model_id": model_id})

        request_id = self.futures.submit(
            ("create", model_id),
            lambda: self.in_trainer(create),
            owner=call.session_id,
            kind="create_model",
            subject=model_id,
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

        kind = "forward" if call.forward_only else "forward_backward"
        return self.ordered(call.model_id, call.seq_id, run, kind)

    def optim_step(self, call: OptimStepCall) -> dict:
        model_id = call.model_id

        def run() -> Outcome:
            with self.metrics.timed("optim_step"):
                metrics = self.models.optim_step(model_id, call.adam)
            self.publish(model_id)
            self.store.model_changed(model_id, step=self.models.steps(model_id))
            return Outcome(json={"type": "optim_step", "metrics": metrics})

        return self.ordered(model_id, call.seq_id, run, "optim_step")

    def fail_in_turn(self, exc: TinkerUserError) -> dict:
        """A request refused while decoding, once its seq_id is known: it fails through
        its future in turn, so the model's later operations (the client already numbered
        them) still run."""
        owner, seq_id = exc.request_key

        def refuse() -> Outcome:
            raise exc

        if owner in self._order:
            return self.ordered(owner, seq_id, refuse, "refused")
        raise exc

    # ---- plumbing ----------------------------------------------------------------

    def record_model(self, model_id: str, state_path=None, user_metadata=None) -> None:
        """Trainer thread: a model just created in `models` goes to the database, or, if
        that fails, leaves memory again (the operation then fails)."""
        spec = asdict(self.models.spec(model_id))
        steps = self.models.steps(model_id)
        try:
            self.store.model_created(
                model_id, self.served.name, spec, steps, state_path, user_metadata
            ).result()
        except Exception:
            self.models.remove(model_id)
            raise

    def register_model(self, model_id: str) -> None:
        """A model just created (or loaded) in `models` takes requests: trainer thread."""
        self.publish(model_id)
        self._order[model_id] = SeqOrder()
        self.offload.added(model_id)

    def publish(self, model_id: str) -> None:
        """The model's weights changed: `inflight` samplers follow. Trainer thread."""
        version = self.latest[model_id][0] + 1 if model_id in self.latest else 0
        weights = self.snapshots.add(self.models.sampler_weights(model_id))
        self.latest[model_id] = (version, weights)

    def _require_model(self, model_id: str) -> None:
        self.heard(model_id, "model_id")
        if model_id not in self._order:
            raise TinkerUserError("model_id", f"unknown model {model_id!r}")

    def ordered(
        self, model_id: str, seq_id: int | None, work: Callable[[], Outcome], kind: str
    ) -> dict:
        """Queue `work` (an operation of `kind`) behind the model's lower seq_ids, to run
        with the model in memory; a request id at once."""
        self._require_model(model_id)
        order = self._order[model_id]
        in_memory = functools.partial(self.offload.run, model_id, work)

        async def run() -> Outcome:
            return await order.run(seq_id, lambda: self.in_trainer(in_memory))

        key = (model_id, seq_id) if seq_id is not None else None
        request_id = self.futures.submit(
            key, run, owner=owner_of(model_id), kind=kind, subject=model_id, seq_id=seq_id
        )
        note(request_id=request_id)
        return {"request_id": request_id, "model_id": model_id}

    async def retrieve(self, request_id: str, long_poll_s: float):
        """A future's outcome, or None while pending (`FutureTable.retrieve`). A poll is
        word from its session's client, and is answered within half the TTL, so that a
        client waiting on a long operation polls again before its session would expire.
        One that memory does not hold is answered from the database (`recovery.py`)."""
        if not self.futures.knows(request_id):
            return await recovery.answer_from_records(self, request_id)
        owner = self.futures.owner(request_id)
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
        """Learn which sessions ended, those of this server's stopped process included;
        wait for the engine to answer; from then on, silent sessions expire and old
        outcomes are forgotten hourly."""
        await session_ops.learn_ended_sessions(self)
        await self.backend.wait_ready()
        loop = asyncio.get_running_loop()
        self._reaper = loop.create_task(session_ops.expire_sessions(self))
        self._pruner = loop.create_task(session_ops.forget_old_outcomes(self))

    async def close(self) -> None:
        for task in (self._reaper, self._pruner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.futures.close()
        self._trainer.shutdown(wait=True, cancel_futures=True)
        await self.engine.close()
        await self.backend.close()
        await asyncio.to_thread(self.store.close)

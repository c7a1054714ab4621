"""What `asyncgrpo tinker-serve` does behind its routes: sessions, training models, samplers.

The HTTP layer (`app.py`) decodes a request and calls one method here. Training work runs
on one worker thread (the models share one base, so one operation at a time), in each
model's `seq_id` order (`futures.SeqOrder`); sampling runs on the engine, its own process,
so a client samples batch n+1 while batch n trains. Every submitted operation answers a
request id at once and its outcome is fetched with `futures.FutureTable.retrieve`.

Ids follow what the SDK assumes: a model created as `model_seq_id` k of session s is
`s:train:k`; a sampler is `s:sample:k`; saved sampler weights live at
`tinker://<model_id>/sampler_weights/<name>`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.base.hardware import threads_here, use_threads_here
from asyncgrpo.tinker import wire
from asyncgrpo.tinker.checkpoints import CheckpointStore, check_name, tinker_path
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import FutureTable, Outcome, SeqOrder
from asyncgrpo.tinker.json_wire import CreateModelCall, OptimStepCall
from asyncgrpo.tinker.limits import TinkerLimits
from asyncgrpo.tinker.sample_wire import SampleCall, check_sample
from asyncgrpo.tinker.sampling import (
    EngineWeights,
    NamedTensors,
    Sampler,
    SamplerRegistry,
    engine_args,
    sample_response,
)


@dataclass
class Session:
    session_id: str
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False


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
    ):
        """`models`: the training models (`training.LoraModels`); `backend`: the engine
        that samples (`asyncgrpo.inference.backend`); `base_adapter`: an adapter that leaves the
        engine at the base weights; `state_dir`: where `tinker://` paths are stored."""
        self.served = served
        self.models = models
        self.backend = backend
        self.limits = limits
        self.futures = FutureTable()
        self.samplers = SamplerRegistry()
        self.checkpoints = CheckpointStore(state_dir)
        self.engine = EngineWeights(backend, lambda: base_adapter)
        self.sessions: dict[str, Session] = {}
        self._order: dict[str, SeqOrder] = {}
        self._latest: dict[str, tuple[int, Any]] = {}  # model id → (version, its weights)
        # the trainer's thread computes on this (building) thread's count, not on whatever
        # process-wide count it would copy at its first op (hardware.use_threads_here)
        self._trainer = ThreadPoolExecutor(
            1, "tinker-train", initializer=use_threads_here, initargs=(threads_here(),)
        )

    # ---- sessions ----------------------------------------------------------------

    def create_session(self) -> dict:
        session_id = f"session-{secrets.token_hex(6)}"
        self.sessions[session_id] = Session(session_id)
        return {"type": "create_session", "session_id": session_id}

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise TinkerUserError("session_id", f"unknown session {session_id!r}")
        session.last_seen = time.monotonic()
        return session

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

        request_id = self.futures.submit(("create", model_id), lambda: self.in_trainer(create))
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
            run = self.models.forward if call.forward_only else self.models.forward_backward
            out = run(call.model_id, call.datums, call.loss_fn, call.loss_fn_config)
            return Outcome(proto=wire.encode_forward_backward_output(out.logprobs, out.metrics))

        return self.ordered(call.model_id, call.seq_id, run)

    def optim_step(self, call: OptimStepCall) -> dict:
        model_id = call.model_id

        def run() -> Outcome:
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

    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id, seq_id = str(body.get("model_id")), body.get("seq_id")
        kind = body.get("kind") or "snapshot"
        name, session_seq = body.get("path"), body.get("sampling_session_seq_id")

        def run() -> Outcome:  # validated in turn, so a bad request still takes its seq_id
            if kind not in ("snapshot", "inflight"):
                raise TinkerUserError("kind", f"must be 'snapshot' or 'inflight', not {kind!r}")
            if (name is None) == (session_seq is None):
                raise TinkerUserError("path", "give one of path and sampling_session_seq_id")
            session = model_id.split(":train:")[0]
            if name is not None:
                path = tinker_path(model_id, "sampler_weights", check_name(str(name)))
                sampler_id = f"{session}:weights:{name}"
            else:
                path, sampler_id = None, f"{session}:sample:{int(session_seq)}"
            snapshot = self._latest[model_id][1] if kind == "snapshot" or path else None
            if path is not None:
                self.checkpoints.save_sampler(path, snapshot)
            self.samplers.add(
                Sampler(
                    sampler_id,
                    self.served.name,
                    model_path=path,
                    weights=snapshot,
                    follows=None if snapshot is not None else model_id,
                )
            )
            result = {"path": path} if path else {"sampling_session_id": sampler_id}
            return Outcome(json={"type": "save_weights_for_sampler", **result})

        return self.ordered(model_id, seq_id, run)

    # ---- sampling ----------------------------------------------------------------

    def create_sampling_session(self, body: dict) -> dict:
        session = self.session(str(body.get("session_id")))
        sampler_id = f"{session.session_id}:sample:{int(body['sampling_session_seq_id'])}"
        path, base = body.get("model_path"), body.get("base_model")
        if path is not None:
            saved = self.samplers.saved(str(path))
            weights = saved.weights if saved else self.checkpoints.load_sampler(str(path))
            sampler = Sampler(sampler_id, self.served.name, str(path), weights)
        elif base == self.served.name:
            sampler = Sampler(sampler_id, self.served.name)
        else:
            raise TinkerUserError(
                "base_model", f"this server samples {self.served.name!r}, not {base!r}"
            )
        self.samplers.add(sampler)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    def sample(self, call: SampleCall) -> dict:
        sampler = self.samplers.get(call.sampling_session_id)
        call = check_sample(call, self.served.vocab_size, self.served.max_length)

        async def run() -> Outcome:
            key, weights = self._weights_of(sampler)
            async with self.engine.holding(key, weights):
                completion = await self.backend.client.complete(
                    call.prompt.tolist(), **engine_args(call)
                )
            return Outcome(proto=sample_response(completion, call))

        key = ("sample", call.sampling_session_id, call.seq_id) if call.seq_id else None
        request_id = self.futures.submit(key, run)
        ids = [f"{request_id}:{i}" for i in range(call.num_samples)]
        return {"request_id": request_id, "sample_sequence_ids": ids}

    def _weights_of(self, sampler: Sampler) -> tuple[tuple, Callable]:
        if sampler.follows is None:
            weights = sampler.weights
            return (("sampler", sampler.sampler_id) if weights else ("base",)), lambda: weights
        version, weights = self._latest[sampler.follows]
        return ("model", sampler.follows, version), lambda: weights

    # ---- plumbing ----------------------------------------------------------------

    def register_model(self, model_id: str) -> None:
        """A model just created (or loaded) in `models` takes requests: trainer thread."""
        self.publish(model_id)
        self._order[model_id] = SeqOrder()

    def publish(self, model_id: str) -> None:
        """The model's weights changed: `inflight` samplers follow. Trainer thread."""
        version = self._latest[model_id][0] + 1 if model_id in self._latest else 0
        self._latest[model_id] = (version, self.models.sampler_weights(model_id))

    def _require_model(self, model_id: str) -> None:
        if model_id not in self._order:
            raise TinkerUserError("model_id", f"unknown model {model_id!r}")

    def ordered(self, model_id: str, seq_id: int | None, work: Callable[[], Outcome]) -> dict:
        """Queue `work` behind the model's lower seq_ids; a request id at once."""
        self._require_model(model_id)
        order = self._order[model_id]

        async def run() -> Outcome:
            return await order.run(seq_id, lambda: self.in_trainer(work))

        key = (model_id, seq_id) if seq_id is not None else None
        return {"request_id": self.futures.submit(key, run), "model_id": model_id}

    async def in_trainer(self, work: Callable[[], Outcome]) -> Outcome:
        return await asyncio.get_running_loop().run_in_executor(self._trainer, work)

    async def start(self) -> None:
        """Wait for the engine to answer."""
        await self.backend.wait_ready()

    async def close(self) -> None:
        await self.futures.close()
        self._trainer.shutdown(wait=True, cancel_futures=True)
        await self.backend.close()

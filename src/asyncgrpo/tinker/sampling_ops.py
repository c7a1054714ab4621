"""The Tinker service's sampling operations: samplers created from a model's weights, a
saved path or the base model, and samples drawn on the engine.

`save_weights_for_sampler` runs in its model's `seq_id` order and fixes what a sampler
samples with: a `snapshot` (the model's weights at that point, also written to
`tinker://<model_id>/sampler_weights/<name>` when named) or `inflight` (the model's newest
weights, whatever step it is at). A sample runs on the engine, beside training, holding
the engine on its sampler's weights (`sampling.EngineWeights`), or, on vLLM, naming the
adapter its sampler's weights were loaded as (`vllm_sampling.VLLMAdapters`).
"""

from __future__ import annotations

from asyncgrpo.inference.server.request_log import note
from asyncgrpo.tinker.checkpoints import check_name, tinker_path
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import Outcome
from asyncgrpo.tinker.sample_wire import SampleCall, check_sample
from asyncgrpo.tinker.sampling import Sampler, sample_response
from asyncgrpo.tinker.sessions import owner_of
from asyncgrpo.tinker.snapshots import SnapshotWeights


def save_weights_for_sampler(svc, body: dict) -> dict:
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
        snapshot = svc.latest[model_id][1] if kind == "snapshot" or path else None
        if path is not None:
            svc.checkpoints.save_sampler(path, snapshot.tensors())
            steps, size = svc.models.steps(model_id), svc.checkpoints.size_bytes(path)
            record = svc.store.checkpoint_saved(path, model_id, "sampler", str(name), steps, size)
            record.result()  # listed before the client hears of it
        svc.samplers.add(
            Sampler(
                sampler_id,
                svc.served.name,
                model_path=path,
                weights=snapshot,
                follows=None if snapshot is not None else model_id,
            )
        )
        result = {"path": path} if path else {"sampling_session_id": sampler_id}
        return Outcome(json={"type": "save_weights_for_sampler", **result})

    return svc.ordered(model_id, seq_id, run, "save_weights_for_sampler")


def create_sampling_session(svc, body: dict) -> dict:
    session = svc.session(str(body.get("session_id")))
    sampler_id = f"{session.session_id}:sample:{int(body['sampling_session_seq_id'])}"
    path, base = body.get("model_path"), body.get("base_model")
    if path is not None:
        saved = svc.samplers.saved(str(path))
        if saved is not None:
            weights = saved.weights
        else:
            weights = svc.snapshots.add(svc.checkpoints.load_sampler(str(path)))
        sampler = Sampler(sampler_id, svc.served.name, str(path), weights)
    elif base == svc.served.name:
        sampler = Sampler(sampler_id, svc.served.name)
    else:
        raise TinkerUserError(
            "base_model", f"this server samples {svc.served.name!r}, not {base!r}"
        )
    svc.samplers.add(sampler)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def get_sampler(svc, sampler_id: str) -> dict:
    svc.heard(sampler_id, "sampler_id")
    sampler = svc.samplers.get(sampler_id)
    return {
        "sampler_id": sampler.sampler_id,
        "base_model": sampler.base_model,
        "model_path": sampler.model_path,
    }


def sample(svc, call: SampleCall) -> dict:
    svc.heard(call.sampling_session_id, "sampling_session_id")
    sampler = svc.samplers.get(call.sampling_session_id)
    call = check_sample(call, svc.served.vocab_size, svc.served.max_length)

    async def run() -> Outcome:
        key, snapshot = _weights_of(svc, sampler)
        with svc.metrics.timed("sample"):
            if snapshot is not None:  # back in memory first if it was offloaded
                await svc.snapshots.use_soon(snapshot)
            weights = snapshot.tensors if snapshot is not None else lambda: None
            completion = await svc.engine.sample(key, weights, call, lambda k: key_in_use(svc, k))
        svc.metrics.sampled_tokens.inc(sum(len(s.token_ids) for s in completion.samples))
        return Outcome(proto=sample_response(completion, call))

    key = ("sample", call.sampling_session_id, call.seq_id) if call.seq_id else None
    # a sample may be syncing weights into the engine: its session's end does not cut it
    owner = owner_of(call.sampling_session_id)
    request_id = svc.futures.submit(
        key,
        run,
        owner=owner,
        interruptible=False,
        kind="sample",
        subject=call.sampling_session_id,
        seq_id=call.seq_id,
    )
    note(request_id=request_id)
    ids = [f"{request_id}:{i}" for i in range(call.num_samples)]
    return {"request_id": request_id, "sample_sequence_ids": ids}


def _weights_of(svc, sampler: Sampler) -> tuple[tuple, SnapshotWeights | None]:
    """The engine's key for the sampler's weights, and those weights (None: the base's)."""
    if sampler.follows is None:
        snapshot = sampler.weights
        return (("sampler", sampler.sampler_id) if snapshot is not None else ("base",)), snapshot
    version, snapshot = svc.latest[sampler.follows]
    return ("model", sampler.follows, version), snapshot


def key_in_use(svc, key: tuple) -> bool:
    """Whether a sampler can still ask for the weights `_weights_of` named `key`: a snapshot
    sampler's while it exists, a model's newest weights until it publishes newer ones."""
    if key[0] == "sampler":
        return key[1] in svc.samplers
    if key[0] == "model":
        latest = svc.latest.get(key[1])
        return latest is not None and latest[0] == key[2]
    return True

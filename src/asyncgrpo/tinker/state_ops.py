"""`save_weights` and `load_weights`: a training model's state to and from `tinker://` paths.

`save_weights` (the SDK's `save_state`) runs in the model's `seq_id` order, so it saves
exactly the weights and Adam moments the operations before it produced. `load_weights`
has two forms: with a `model_id` it loads into that model in its order (the SDK's
`load_state[_with_optimizer]`); with a `session_id` and `model_seq_id` it creates the model
from the checkpoint's own `lora_config` (`create_training_client_from_state`), whose
operations then start at seq_id 1. Every save is recorded in the database before the client
hears of it (so a restart lists it), as is each model's step count and state path.
"""

from __future__ import annotations

from asyncgrpo.tinker.checkpoints import check_name, tinker_path
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.futures import Outcome
from asyncgrpo.tinker.json_wire import read_field


def save_weights(svc, body: dict) -> dict:
    model_id = read_field(body, "model_id", str)
    seq_id = read_field(body, "seq_id", int, default=None)

    def run() -> Outcome:
        name = check_name(read_field(body, "path", str))
        path = tinker_path(model_id, "weights", name)
        state = svc.models.state(model_id)
        svc.checkpoints.save_state(path, state, svc.served.name)
        steps, size = int(state.meta["steps"]), svc.checkpoints.size_bytes(path)
        svc.store.checkpoint_saved(path, model_id, "training", name, steps, size).result()
        return Outcome(json={"type": "save_weights", "path": path})

    return svc.ordered(model_id, seq_id, run, "save_weights")


def load_weights(svc, body: dict) -> dict:
    path = read_field(body, "path", str)
    with_optimizer = read_field(body, "optimizer", bool, default=False)
    model_id = read_field(body, "model_id", str, default=None)
    if model_id is not None:

        def load_into() -> Outcome:
            svc.models.load_state(model_id, _read(svc, path), with_optimizer)
            svc.publish(model_id)
            svc.store.model_changed(model_id, step=svc.models.steps(model_id), state_path=path)
            return _loaded(path, model_id)

        seq_id = read_field(body, "seq_id", int, default=None)
        return svc.ordered(model_id, seq_id, load_into, "load_weights")

    session = svc.session(read_field(body, "session_id", str))
    model_id = f"{session.session_id}:train:{read_field(body, 'model_seq_id', int)}"
    user_metadata = read_field(body, "user_metadata", dict, default=None)

    def create_from() -> Outcome:
        state = _read(svc, path)
        svc.models.create(model_id, **state.spec)
        try:
            svc.models.load_state(model_id, state, with_optimizer)
        except BaseException:
            svc.models.remove(model_id)
            raise
        svc.record_model(model_id, state_path=path, user_metadata=user_metadata)
        svc.register_model(model_id)
        return _loaded(path, model_id)

    request_id = svc.futures.submit(
        ("create", model_id),
        lambda: svc.in_trainer(create_from),
        owner=session.session_id,
        kind="load_weights",
        subject=model_id,
    )
    return {"request_id": request_id, "model_id": model_id}


def _read(svc, path: str):
    state, base_model = svc.checkpoints.load_state(path)
    if base_model != svc.served.name:
        raise TinkerUserError(
            "path", f"{path!r} was trained on {base_model!r}; this server serves "
            f"{svc.served.name!r}"
        )  # fmt: skip
    return state


def _loaded(path: str, model_id: str) -> Outcome:
    return Outcome(json={"type": "load_weights", "path": path, "model_id": model_id})

"""`asyncgrpo tinker-serve` on its database: the SDK's listings, a deleted checkpoint, and a
second server process on the same database and state directory.

Runs on SQLite (the default, under `--state-dir`) and, marked `postgres`, on a PostgreSQL
database (`--database postgresql://...`), driven by the real `tinker` SDK (0.38): what a
program lists (`RestClient`), what it deletes, and what the next server process finds: the
saved paths, the runs, and the session it did not get to end, refused as ended by the stop.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tinker_server import API_KEY, datum, running_tinker

pytestmark = pytest.mark.heavy  # two servers with their engines: about 30 s per database

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types
TOKENS = list(range(40, 60))


def logprobs(trainer) -> np.ndarray:
    sft = datum(TOKENS, weights=np.ones(len(TOKENS) - 1))
    return (
        trainer.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )


def train_and_save(url: str, base: str) -> dict:
    """A client's run: a model trained a step, two states and a sampler path saved, one
    state deleted; what the listings said, and the first state's log-probs."""
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    meta = {"experiment": "db"}
    trainer = client.create_lora_training_client(base, rank=4, seed=1, user_metadata=meta).result()
    sft = datum(TOKENS, weights=np.ones(len(TOKENS) - 1))
    trainer.forward_backward([sft], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    first = trainer.save_state("first").result().path
    sampler = trainer.save_weights_for_sampler("first").result().path
    second = trainer.save_state("second").result().path
    rest = tinker.RestClient(base_url=url, api_key=API_KEY)
    listed = [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    everyone = rest.list_user_checkpoints(limit=2).result()
    session_id = trainer.model_id.split(":")[0]
    session = rest.get_session(session_id).result()
    run = rest.get_training_run(trainer.model_id).result()
    rest.delete_checkpoint_from_tinker_path(second).result()
    after_delete = rest.list_checkpoints(trainer.model_id).result().checkpoints
    with pytest.raises(Exception, match="nothing is saved"):
        client.create_training_client_from_state(second).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("session-none:train:0").result()
    out = dict(model_id=trainer.model_id, first=first, sampler=sampler, second=second)
    out.update(listed=listed, everyone=everyone, session=session, run=run)
    out.update(after_delete=[c.tinker_path for c in after_delete], logprobs=logprobs(trainer))
    out["listed_sessions"] = rest.list_sessions().result().sessions
    client.close("success").result(timeout=60)
    return out


def test_listings_deletion_and_the_next_server_on_one_database(
    tiny_model_dir, tmp_path, database_url
):
    base, state = str(tiny_model_dir), tmp_path / "state"
    with running_tinker(tiny_model_dir, state, database=database_url) as (url, _):
        run = train_and_save(url, base)
        live = httpx.post(  # a session whose client is still there when the server stops
            f"{url}/api/v1/create_session",
            json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"},
            headers={"X-API-Key": API_KEY},
        ).json()["session_id"]
        refusals = _refusals(url)
    assert refusals == [400, 400, 404, 404, 404, 422, 404], refusals
    model_id = run["model_id"]
    assert run["listed"] == [run["second"], run["sampler"], run["first"]]  # newest first
    assert len(run["everyone"].checkpoints) == 2 and run["everyone"].cursor.total_count == 3
    assert run["session"].training_run_ids == [model_id]
    assert run["run"].user_metadata == {"experiment": "db"}
    assert run["run"].last_checkpoint.tinker_path == run["second"]
    assert run["after_delete"] == [run["sampler"], run["first"]]
    assert model_id.split(":")[0] in run["listed_sessions"]

    with running_tinker(tiny_model_dir, state, database=database_url) as (url, _):
        heartbeat = httpx.post(
            f"{url}/api/v1/session_heartbeat",
            json={"session_id": live},
            headers={"X-API-Key": API_KEY},
        )
        assert (
            heartbeat.status_code == 410
            and "ended when tinker-serve stopped" in (heartbeat.json()["error"])
        )
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        rest = tinker.RestClient(base_url=url, api_key=API_KEY)
        saved = [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints]
        assert saved == [run["sampler"], run["first"]]
        info = rest.get_weights_info_by_tinker_path(run["first"]).result()
        assert (info.base_model, info.lora_rank, info.train_mlp) == (base, 4, True)
        resumed = client.create_training_client_from_state_with_optimizer(run["first"]).result()
        assert np.array_equal(logprobs(resumed), run["logprobs"])
        client.close("success").result(timeout=60)


def _refusals(url: str) -> list[int]:
    """The statuses of listing requests that are wrong (400), ask for what was never saved
    (404) or page out of bounds (422): none may be a server error."""
    key = {"X-API-Key": API_KEY}
    calls = [
        ("POST", "/weights_info", {"content": b"not json"}),
        ("POST", "/weights_info", {"json": {"tinker_path": "s3://elsewhere"}}),
        ("POST", "/weights_info", {"json": {"tinker_path": "tinker://s:train:0/weights/x"}}),
        ("DELETE", "/training_runs/s:train:0/checkpoints/weights/x", {}),
        ("GET", "/training_runs/s:train:0", {}),
        ("GET", "/training_runs?limit=0", {}),
        ("GET", "/sessions/session-none", {}),
    ]
    return [
        httpx.request(method, f"{url}/api/v1{route}", headers=key, **args).status_code
        for method, route, args in calls
    ]

"""`asyncgrpo tinker-serve` killed with SIGKILL and started again loses nothing saved.

A client of the real `tinker` SDK (0.38) trains a model, saves its state and sampler
weights, and has a long `forward_backward` running when the server process is killed. The
server is started again on the same port and `--state-dir`. Then:

- the future that died with the process fails at once with an error saying so (the SDK
  raises it; no hang, no endless retries), and the dead session's next request is refused
  with the session-ended error, which names what survives;
- a new client resumes from the saved state, bit-identical (log-probs and the next step),
  and samples from the saved sampler weights exactly as before;
- the listings (`list_checkpoints`, `get_training_run`, `list_training_runs`,
  `weights_info`) still hold the saved paths, served from the database.
"""

from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest
from tinker_process import API_KEY, TinkerProcess
from tinker_server import datum

pytestmark = pytest.mark.heavy  # two server starts and the SDK's reconnection: about a minute

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types

TOKENS = list(range(40, 60))
PROMPT = [40, 41, 42]
SAMPLING = dict(max_tokens=6, seed=5, stop=[])


def sft(tokens=TOKENS):
    return datum(tokens, weights=np.ones(len(tokens) - 1))


def logprobs(trainer) -> np.ndarray:
    out = trainer.forward([sft()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return out.to_numpy()


def step(trainer) -> np.ndarray:
    trainer.forward_backward([sft()], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return logprobs(trainer)


def sample(client, path: str) -> list[int]:
    sampler = client.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(**SAMPLING)
    return list(sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
                .sequences[0].tokens)  # fmt: skip


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    process = TinkerProcess(tiny_model_dir, tmp_path / "state", tmp_path)
    process.start()
    yield process
    process.stop()


def test_a_killed_server_restarts_with_everything_saved(server, tiny_model_dir):
    base = str(tiny_model_dir)
    client = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    trainer = client.create_lora_training_client(base_model=base, rank=4, seed=3).result()
    step(trainer)
    state = trainer.save_state("before-kill").result().path
    weights = trainer.save_weights_for_sampler("before-kill").result().path
    saved_logprobs, sampled = logprobs(trainer), sample(client, weights)
    next_logprobs = step(trainer)  # what the saved state's next step gives
    running = trainer.forward_backward([sft(list(range(20, 276)))] * 512, "cross_entropy")
    _wait_for_recorded_work(server, trainer.model_id)

    server.kill()
    server.start()
    started = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as died:
        running.result(timeout=240)
    assert time.monotonic() - started < 120  # the SDK's reconnection backoff, then at once
    assert "forward_backward" in str(
        died.value
    ) and "still running when tinker-serve stopped" in str(died.value), died.value
    assert state in str(died.value) and died.value.category.value == "server"
    with pytest.raises(Exception, match="ended when tinker-serve stopped") as ended:
        trainer.forward([sft()], "cross_entropy").result(timeout=60)
    assert "create_training_client_from_state_with_optimizer" in str(ended.value)

    again = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    resumed = again.create_training_client_from_state_with_optimizer(state).result()
    assert np.array_equal(logprobs(resumed), saved_logprobs)
    assert np.array_equal(step(resumed), next_logprobs)
    assert sample(again, weights) == sampled

    rest = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    saved = rest.list_checkpoints(trainer.model_id).result().checkpoints
    assert {(c.tinker_path, c.checkpoint_type) for c in saved} == {
        (state, "training"),
        (weights, "sampler"),
    }
    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.lora_rank, run.base_model) == (trainer.model_id, 4, base)
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == weights
    runs = {r.training_run_id for r in rest.list_training_runs().result().training_runs}
    assert {trainer.model_id, resumed.model_id} <= runs
    info = rest.get_weights_info_by_tinker_path(weights).result()
    assert (info.base_model, info.lora_rank, info.is_lora) == (base, 4, True)
    client.close("errored").result(timeout=60)  # finishing the ended session: no error
    again.close("success").result(timeout=60)


def _wait_for_recorded_work(server: TinkerProcess, model_id: str, timeout: float = 60) -> None:
    """Until the server runs the client's long operation and has recorded it (within
    milliseconds of its arrival; a kill in between leaves an operation the restarted server
    knows only by its request id, whose answer `test_tinker_store.py` checks)."""
    database = server.state_dir / "tinker.sqlite3"
    query = "SELECT count(*) FROM futures WHERE model_id = ? AND status = 'pending'"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        queued = server.metric(f'asyncgrpo_tinker_model_queue_depth{{model="{model_id}"}}')
        if queued >= 1:
            with sqlite3.connect(database) as connection:
                if connection.execute(query, (model_id,)).fetchone()[0] >= 1:
                    return
        time.sleep(0.05)
    raise TimeoutError("the long forward_backward never reached the server's records")

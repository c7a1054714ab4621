"""`asyncgrpo tinker-serve` driven by the real `tinker` SDK (0.38), unmodified.

The server runs on the tiny random model in fp32 (so the trainer's and
the sampler's log-probs agree to ~1e-5); every test talks to it only through
`tinker.ServiceClient`, as a user's program would.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import numpy as np
import pytest
import torch
from tinker_server import API_KEY, datum, serve_tinker

pytest.importorskip("peft")
tinker = pytest.importorskip("tinker")
types = tinker.types
TOLERANCE_FP32 = 1e-4


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    with serve_tinker(tiny_model_dir, tmp_path_factory.mktemp("tinker-state")) as url:
        yield url


@pytest.fixture(scope="module")
def service(server_url):
    os.environ["TINKER_TELEMETRY"] = "0"
    # closed before the module's server stops: an open session's SDK would keep sending
    # heartbeats to the stopped server (and logging their failures) until the process ends
    with tinker.ServiceClient(base_url=server_url, api_key=API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return str(tiny_model_dir)


def test_the_dynamic_client_config_is_served_as_the_sdk_reads_it(server_url):
    """The SDK's own call (the one its client makes at start and every refresh period),
    with its strict response validation: a 404 or a body of another shape raises."""
    from tinker._client import AsyncTinker  # the client the SDK's ServiceClient sends with

    from asyncgrpo.tinker.app import DYNAMIC_CLIENT_CONFIG

    async def fetch():
        async with AsyncTinker(
            base_url=server_url, api_key=API_KEY, _strict_response_validation=True
        ) as client:
            request = types.ClientConfigRequest(sdk_version=tinker.__version__)
            return await client.service.client_dynamic_config(request=request, max_retries=0)

    config = asyncio.run(fetch())
    assert isinstance(config, types.ClientDynamicConfigResponse)
    assert config.model_dump() == DYNAMIC_CLIENT_CONFIG
    assert config.sample_cancel_enabled is False  # no cancel_future route to send to


def test_sft_with_cross_entropy_lowers_the_loss(service, base_model):
    trainer = service.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
    tokens = list(range(5, 25))
    sft = datum(tokens, weights=np.ones(len(tokens) - 1))
    losses = []
    for _ in range(4):
        out = trainer.forward_backward([sft], "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0] - 0.5, losses
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (len(tokens) - 1,)
    assert abs(-logprobs.sum() - losses[-1]) < 1e-3  # weights 1: the loss is −Σ log-probs


def test_the_trainer_scores_a_sample_as_the_sampler_did(service, base_model):
    trainer = service.create_lora_training_client(base_model=base_model, rank=8, seed=1).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([3, 14, 15, 92, 65])
    params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=7, stop=[])
    result = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.tokens) == 12 and seq.stop_reason == "length"
        tokens = prompt.to_ints() + list(seq.tokens)
        scored = trainer.forward([datum(tokens, weights=np.ones(len(tokens) - 1))], "cross_entropy")
        scored = scored.result()
        learner = scored.loss_fn_outputs[0]["logprobs"].to_numpy()[-len(seq.tokens) :]
        assert np.max(np.abs(learner - np.array(seq.logprobs))) < TOLERANCE_FP32


def test_a_snapshot_keeps_its_weights_and_inflight_follows(service, base_model):
    trainer = service.create_lora_training_client(base_model=base_model, rank=8, seed=2).result()
    prompt = types.ModelInput.from_ints([7, 8, 9, 10])
    params = types.SamplingParams(max_tokens=8, seed=3, stop=[])

    def draw(client):
        seq = client.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        return list(seq.tokens), list(seq.logprobs)

    old = trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
    inflight = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    before = draw(old)
    assert draw(inflight) == before  # same weights so far
    tokens = prompt.to_ints() + before[0]
    sft = datum(tokens, weights=np.ones(len(tokens) - 1))
    for _ in range(3):
        trainer.forward_backward([sft], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    new = trainer.save_weights_and_get_sampling_client().result()
    trained = draw(new)
    assert trained[1] != before[1]  # the new sampler serves the trained weights
    assert draw(inflight) == trained  # inflight follows the newest weights
    assert draw(old) == before  # the old snapshot still samples with its own


def test_two_models_train_independently(service, base_model):
    a = service.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    b = service.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    probe = datum(list(range(30, 45)), weights=np.ones(14))
    before = b.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    sft = datum(list(range(30, 45)), weights=np.ones(14))
    a.forward_backward([sft], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after_b = b.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    after_a = a.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert np.array_equal(before.to_numpy(), after_b.to_numpy())
    assert not np.allclose(before.to_numpy(), after_a.to_numpy())


def test_bad_inputs_fail_fast_as_user_errors_and_the_server_keeps_serving(
    service, base_model, server_url
):
    trainer = service.create_lora_training_client(base_model=base_model, rank=4, seed=4).result()
    good = datum(list(range(5, 15)), weights=np.ones(9))
    cases = {  # what is wrong -> the request field the error must name
        "unknown loss": ([good], "no_such_loss", "loss_fn"),
        "lengths disagree": (
            [datum(list(range(5, 15)), weights=np.ones(4))],
            "cross_entropy",
            "loss_fn_inputs.weights",
        ),
        "token outside the vocabulary": (
            [datum([5, 6, 10**6], weights=[1, 1])],
            "cross_entropy",
            "target_tokens",
        ),
        "stable_reinforce": ([good], "stable_reinforce", "importance_sampling"),
        "missing input": ([good], "importance_sampling", "loss_fn_inputs.logprobs"),
    }
    for name, (data, loss, field) in cases.items():
        start = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as info:
            trainer.forward_backward(data, loss).result(timeout=30)
        assert time.monotonic() - start < 10, name
        assert info.value.category == tinker.types.RequestErrorCategory.User, name
        assert field in str(info.value), (name, str(info.value))
    out = trainer.forward_backward([good], "cross_entropy").result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"])
    wrong = httpx.post(
        f"{server_url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"}
    )
    assert wrong.status_code == 401


def test_saved_state_restores_bit_identical_and_takes_the_same_next_step(service, base_model):
    trainer = service.create_lora_training_client(base_model=base_model, rank=4, seed=5).result()
    sft = datum(list(range(50, 70)), weights=np.ones(19))
    adam = types.AdamParams(learning_rate=2e-2)
    for _ in range(2):
        trainer.forward_backward([sft], "cross_entropy").result()
        trainer.optim_step(adam).result()
    path = trainer.save_state("two-steps").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/two-steps")

    def logprobs(client):
        return client.forward([sft], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]

    def next_step(client):
        client.forward_backward([sft], "cross_entropy").result()
        client.optim_step(adam).result()
        return logprobs(client).to_numpy()

    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert np.array_equal(logprobs(restored).to_numpy(), logprobs(trainer).to_numpy())
    assert np.array_equal(next_step(restored), next_step(trainer))
    fresh_adam = service.create_training_client_from_state(path).result()
    trainer.load_state(path).result()  # back to step 2 in place, Adam state kept
    assert np.array_equal(logprobs(trainer).to_numpy(), logprobs(fresh_adam).to_numpy())


def test_a_named_sampler_path_serves_its_weights_to_a_new_sampling_client(service, base_model):
    trainer = service.create_lora_training_client(base_model=base_model, rank=4, seed=6).result()
    sft = datum(list(range(80, 95)), weights=np.ones(14))
    trainer.forward_backward([sft], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler("step-1").result().path
    assert path.endswith("/sampler_weights/step-1")
    prompt = types.ModelInput.from_ints([80, 81, 82])
    params = types.SamplingParams(max_tokens=6, seed=9, stop=[])
    direct = trainer.create_sampling_client(path).result().sample(prompt, 1, params).result()
    sampler = service.create_sampling_client(model_path=path).result()
    other = sampler.sample(prompt, 1, params).result()
    assert list(direct.sequences[0].logprobs) == list(other.sequences[0].logprobs)


def test_sampling_completes_while_a_long_forward_backward_runs(service, base_model):
    """The engine is its own process: a sample submitted after a long forward_backward
    finishes before it, as an asynchronous RL client needs."""
    trainer = service.create_lora_training_client(base_model=base_model, rank=4, seed=7).result()
    sampler = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    prompt = types.ModelInput.from_ints([11, 12, 13])
    params = types.SamplingParams(max_tokens=4, seed=1, stop=[])
    sampler.sample(prompt, 1, params).result()  # the engine holds this sampler's weights
    rng = np.random.default_rng(0)
    heavy = [
        datum(rng.integers(5, 400, size=400).tolist(), weights=np.ones(399)) for _ in range(48)
    ]
    start = time.monotonic()
    training = trainer.forward_backward(heavy, "cross_entropy")
    sampled = sampler.sample(prompt, 2, params)
    sampled.result()
    sampled_at = time.monotonic() - start
    training.result()
    trained_at = time.monotonic() - start
    assert sampled_at < trained_at / 2, (sampled_at, trained_at)


def _reference_loss(name: str, tlp, slp, adv, config, seq_mask=None):
    """Tinker's documented losses written out in torch (sum over tokens), apart from
    `asyncgrpo.tinker.losses`."""
    ratio = torch.exp(tlp - slp)
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()
    if name == "cispo":
        return -(ratio.clamp(lo, hi).detach() * tlp * adv).sum()
    if name == "dro":
        return -(tlp * adv - 0.5 * config["beta"] * (tlp - slp) ** 2).sum()
    sequence = ((tlp.detach() - slp) * seq_mask).sum() / seq_mask.sum()  # gspo
    ratio = torch.exp(sequence + tlp - tlp.detach())
    return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()


LOSS_CASES = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 1.05},
    "dro": {"beta": 0.5},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
}


@pytest.mark.parametrize("loss", sorted(LOSS_CASES))
def test_each_loss_and_its_gradient_equal_a_hand_computation(service, base_model, loss):
    """`loss:sum` equals the formula applied to the returned log-probs; and one step on it
    moves the weights exactly as one step on the same formula run client-side through
    `forward_backward_custom` (Adam with eps 1 is a smooth function of each gradient
    element, so equal steps mean equal gradients)."""
    config = {**LOSS_CASES[loss]}
    tokens = list(range(100, 124))
    probe = datum(tokens, weights=np.ones(len(tokens) - 1))
    fixed, custom = (
        service.create_lora_training_client(base_model=base_model, rank=4, seed=8).result()
        for _ in range(2)
    )
    learner = fixed.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    rng = np.random.default_rng(1)
    n = len(tokens) - 1
    inputs = {
        "logprobs": learner.to_numpy() + rng.normal(0, 0.15, n),  # ratios on both clip sides
        "advantages": rng.choice([-1.0, 0.5, 2.0], n),
    }
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = (np.arange(n) % 3 != 0).astype(np.float32)
    rl = datum(tokens, **inputs)
    tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}
    out = fixed.forward_backward([rl], loss, config).result()
    tlp = torch.tensor(out.loss_fn_outputs[0]["logprobs"].to_numpy())
    hand = _reference_loss(
        loss, tlp, tensors["logprobs"], tensors["advantages"], config,
        tensors.get("sequence_ratio_mask"),
    )  # fmt: skip
    assert out.metrics["loss:sum"] == pytest.approx(float(hand), rel=1e-4, abs=1e-4)

    def client_side(data, logprobs_list):
        lp = logprobs_list[0]
        return _reference_loss(
            loss, lp, tensors["logprobs"], tensors["advantages"], config,
            tensors.get("sequence_ratio_mask"),
        ), {}  # fmt: skip

    custom.forward_backward_custom([rl], client_side).result()
    adam = types.AdamParams(learning_rate=0.05, eps=1.0)
    fixed.optim_step(adam).result()
    custom.optim_step(adam).result()
    after = [
        c.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        for c in (fixed, custom)
    ]
    moved = np.abs(after[0] - learner.to_numpy()).max()
    assert moved > 1e-3, moved
    assert np.abs(after[0] - after[1]).max() < 1e-3 * moved


def test_compute_logprobs_equals_the_trainers_forward(service, base_model):
    """Prompt log-probs (`compute_logprobs`, and `sample` with top-k prompt log-probs) are
    the learner's log-probs of the same tokens, under the same weights."""
    trainer = service.create_lora_training_client(base_model=base_model, rank=4, seed=9).result()
    tokens = [21, 5, 77, 130, 9, 41, 300, 12]
    trainer.forward_backward([datum(tokens, weights=np.ones(7))], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens)
    scored = sampler.compute_logprobs(prompt).result()
    learner = trainer.forward([datum(tokens, weights=np.ones(7))], "cross_entropy").result()
    expected = learner.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert scored[0] is None and len(scored) == len(tokens)
    assert np.max(np.abs(np.array(scored[1:]) - expected)) < TOLERANCE_FP32
    params = types.SamplingParams(max_tokens=1, seed=0)
    top = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    rows = top.topk_prompt_logprobs
    assert rows[0] is None and all(len(row) == 3 for row in rows[1:])
    assert all(row[0][1] >= row[1][1] >= row[2][1] for row in rows[1:])

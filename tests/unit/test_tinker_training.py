"""Several LoRA models on one base (asyncgrpo.tinker.training): independence of weights,
gradients and Adam state, the datum layout against a plain forward, state round trips,
and SFT that learns, on a tiny Llama built in code."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from asyncgrpo.base.config import TrainerConfig
from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.testing import build_tiny_llama
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.lora_state import adapter_factors
from asyncgrpo.tinker.training import LORA_ALPHA, LoraModels, train_datum
from asyncgrpo.tinker.wire import TinkerDatum

VOCAB = 48
ADAM = AdamParams(learning_rate=1e-2)


def make_models(budget: int = 4096) -> LoraModels:
    return LoraModels(
        build_tiny_llama(VOCAB, seed=0),
        TrainerConfig(bf16_autocast=False, micro_batch_tokens=budget),
    )


def ids(n: int, seed: int) -> np.ndarray:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).numpy()


def ce_datum(seed: int, n: int = 10) -> TinkerDatum:
    weights = np.linspace(-0.5, 1.0, n).astype(np.float32)  # negative weights too
    return TinkerDatum(ids(n, seed), {"target_tokens": ids(n, seed + 1000), "weights": weights})


def rl_datum(seed: int, n: int = 8) -> TinkerDatum:
    rng = np.random.default_rng(seed)
    inputs = {
        "target_tokens": ids(n, seed + 1000),
        "logprobs": -rng.uniform(2.0, 5.0, n).astype(np.float32),
        "advantages": rng.choice([-1.0, 0.0, 1.0], n).astype(np.float32),
    }
    return TinkerDatum(ids(n, seed), inputs)


def batch(seed: int = 0) -> list[TinkerDatum]:
    return [ce_datum(seed), ce_datum(seed + 1, 5), ce_datum(seed + 2, 13)]


def logprobs(models: LoraModels, model_id: str, datums=None) -> list[np.ndarray]:
    return models.forward(model_id, datums or batch(7), "cross_entropy").logprobs


def grads(models: LoraModels, model_id: str) -> dict[str, torch.Tensor | None]:
    adapter = models.models[model_id].adapter
    factors = adapter_factors(models.peft_model, adapter)
    return {n: None if p.grad is None else p.grad.clone() for n, p in factors.items()}


def test_a_datum_position_predicts_its_target_token():
    models = make_models()
    models.create("a", rank=4, seed=1)
    datum = ce_datum(3, n=9)
    got = logprobs(models, "a", [datum])[0]
    with torch.no_grad():  # a fresh adapter's B is 0: the plain model's log-softmax
        logits = models.peft_model(torch.as_tensor(datum.tokens)[None]).logits[0]
    want = logits.log_softmax(-1)[torch.arange(9), torch.as_tensor(datum.inputs["target_tokens"])]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    converted = train_datum(datum, ("weights",))
    assert (
        converted.num_targets == 9 and converted.targets == datum.inputs["target_tokens"].tolist()
    )


def test_the_trained_head_adapter_acts_in_the_trainers_logprobs():
    """train_unembed's lm_head adapter trains and shapes the log-probs exactly as peft's
    own forward applies it (the trainer's fused head would otherwise skip it)."""
    models = make_models()
    models.create("a", rank=4, seed=1, train_attn=False, train_mlp=False)
    for _ in range(2):
        models.forward_backward("a", batch(), "cross_entropy")
        models.optim_step("a", ADAM)
    head_b = adapter_factors(models.peft_model, "tinker_0")[
        "base_model.model.lm_head.lora_B.weight"
    ]
    assert head_b.abs().sum() > 0
    datum = ce_datum(3, n=9)
    got = logprobs(models, "a", [datum])[0]
    with torch.no_grad():
        logits = models.peft_model(torch.as_tensor(datum.tokens)[None]).logits[0]
    want = logits.log_softmax(-1)[torch.arange(9), torch.as_tensor(datum.inputs["target_tokens"])]
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_training_one_model_leaves_the_other_bit_identical():
    models = make_models()
    models.create("a", rank=4, seed=1)
    models.create("b", rank=8, seed=2, train_unembed=False)
    before_a, before_b = logprobs(models, "a"), logprobs(models, "b")
    for _ in range(2):
        models.forward_backward("a", batch(), "cross_entropy")
        models.optim_step("a", ADAM)
    after_a, after_b = logprobs(models, "a"), logprobs(models, "b")
    for old, new in zip(before_b, after_b, strict=True):
        assert np.array_equal(old, new)
    assert not all(np.array_equal(o, n) for o, n in zip(before_a, after_a, strict=True))


def test_an_optim_step_touches_only_its_own_gradients_and_weights():
    models = make_models(budget=16)  # several micro-batches per call
    models.create("a", rank=4, seed=1)
    models.create("b", rank=4, seed=2)
    models.forward_backward("a", batch(), "cross_entropy")
    models.forward_backward("b", [rl_datum(5), rl_datum(6)], "ppo")
    a_grads, b_grads = grads(models, "a"), grads(models, "b")
    assert all(g is not None for g in b_grads.values())
    a_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in a_grads.values()]))
    b_weights = [
        p.detach().clone() for p in adapter_factors(models.peft_model, "tinker_1").values()
    ]
    metrics = models.optim_step("a", AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3))
    assert metrics["grad_norm:mean"] == pytest.approx(float(a_norm), rel=1e-5)  # A's alone
    assert all(g is None for g in grads(models, "a").values())
    for name, grad in grads(models, "b").items():
        assert torch.equal(grad, b_grads[name])
    for old, new in zip(
        b_weights, adapter_factors(models.peft_model, "tinker_1").values(), strict=True
    ):
        assert torch.equal(old, new)


def test_state_round_trip_gives_identical_logprobs_and_the_same_next_step():
    models = make_models()
    models.create("a", rank=4, seed=1)
    for seed in (0, 10):
        models.forward_backward("a", batch(seed), "cross_entropy")
        models.optim_step("a", ADAM)
    state = models.state("a")
    assert all(isinstance(t, torch.Tensor) for t in state.tensors.values())
    assert any(k.startswith("optimizer.") for k in state.tensors)

    restored = make_models()
    restored.create("a2", **state.spec)
    restored.load_state("a2", state, with_optimizer=True)
    for old, new in zip(logprobs(models, "a"), logprobs(restored, "a2"), strict=True):
        assert np.array_equal(old, new)
    for m, model_id in ((models, "a"), (restored, "a2")):
        m.forward_backward(model_id, batch(20), "cross_entropy")
        m.optim_step(model_id, ADAM)
    for old, new in zip(logprobs(models, "a"), logprobs(restored, "a2"), strict=True):
        assert np.array_equal(old, new)

    fresh_adam = make_models()  # without the optimizer the next step differs
    fresh_adam.create("a3", **state.spec)
    fresh_adam.load_state("a3", state, with_optimizer=False)
    fresh_adam.forward_backward("a3", batch(20), "cross_entropy")
    fresh_adam.optim_step("a3", ADAM)
    assert not np.array_equal(logprobs(models, "a")[0], logprobs(fresh_adam, "a3")[0])


def test_cross_entropy_sft_lowers_the_loss():
    models = make_models()
    models.create("sft", rank=8, seed=0)
    datum = TinkerDatum(
        ids(12, 1), {"target_tokens": ids(12, 2), "weights": np.ones(12, np.float32)}
    )
    losses = []
    for _ in range(6):
        out = models.forward_backward("sft", [datum], "cross_entropy")
        losses.append(out.metrics["loss:sum"])
        assert losses[-1] == pytest.approx(-float(out.logprobs[0].sum()), rel=1e-5)  # the NLL
        models.optim_step("sft", AdamParams(learning_rate=2e-2))
    assert losses[-1] < 0.7 * losses[0]


def test_forward_reports_the_loss_forward_backward_computes():
    models = make_models()
    models.create("a", rank=4, seed=1)
    datums = [rl_datum(1), rl_datum(2, n=5)]
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    seen = models.forward("a", datums, "ppo", config)
    done = models.forward_backward("a", datums, "ppo", config)
    assert seen.metrics.keys() == done.metrics.keys() == {"loss:sum", "clip_fraction:mean"}
    assert seen.metrics["loss:sum"] == pytest.approx(done.metrics["loss:sum"], rel=1e-5)
    for a, b in zip(seen.logprobs, done.logprobs, strict=True):
        assert a.dtype == np.float32 and a.shape == (len(b),)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_seed_makes_the_initial_adapter_reproducible():
    models = make_models()
    models.create("a", rank=4, seed=7)
    models.create("b", rank=4, seed=7)
    models.create("c", rank=4, seed=8)
    a, b, c = (dict(models.sampler_weights(m)) for m in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("lora_A.weight"))


def test_sampler_weights_are_peft_names_with_the_scale_in_b():
    models = make_models()
    models.create("a", rank=4, seed=1, train_mlp=False)
    models.forward_backward("a", batch(), "cross_entropy")
    models.optim_step("a", ADAM)
    published = dict(models.sampler_weights("a"))
    factors = adapter_factors(models.peft_model, "tinker_0")
    assert published.keys() == factors.keys()
    assert "base_model.model.lm_head.lora_B.weight" in published
    assert not any("mlp" in name for name in published)
    for name, tensor in published.items():
        assert name.startswith("base_model.model.")
        scale = LORA_ALPHA / 4 if name.endswith("lora_B.weight") else 1.0
        assert torch.equal(tensor, factors[name].detach() * scale)
    assert any(t.abs().sum() > 0 for n, t in published.items() if n.endswith("lora_B.weight"))


def test_remove_keeps_the_other_models_serving():
    models = make_models()
    models.create("a", rank=4, seed=1)
    models.create("b", rank=4, seed=2)
    before = logprobs(models, "b")
    models.remove("a")
    assert "a" not in models.models
    for old, new in zip(before, logprobs(models, "b"), strict=True):
        assert np.array_equal(old, new)


def test_removed_models_leave_memory_the_last_one_too():
    """What a session's end relies on: after `remove`, nothing holds a model's adapter,
    gradients or Adam state, and a model created afterwards starts as on a fresh base."""
    models = make_models()
    held = []
    for model_id, seed in (("a", 1), ("b", 2)):
        models.create(model_id, rank=4, seed=seed)
        models.forward_backward(model_id, batch(), "cross_entropy")
        models.optim_step(model_id, ADAM)
        models.forward_backward(model_id, batch(1), "cross_entropy")  # gradients pending
        trainer = models.models[model_id].trainer
        factors = adapter_factors(models.peft_model, models.models[model_id].adapter)
        held += [weakref.ref(trainer), weakref.ref(trainer.optimizer)]
        held += [weakref.ref(p) for p in factors.values()]
        held += [
            weakref.ref(s) for p in factors.values() for s in trainer.optimizer.state[p].values()
        ]
        del trainer, factors
    models.remove("a")
    models.remove("b")
    gc.collect()
    assert held and [ref() for ref in held] == [None] * len(held)
    assert not any("lora_" in name for name, _ in models.peft_model.named_parameters())
    models.create("c", rank=4, seed=1)
    fresh = make_models()
    fresh.create("c", rank=4, seed=1)
    for old, new in zip(logprobs(fresh, "c"), logprobs(models, "c"), strict=True):
        assert np.array_equal(old, new)


def test_concurrent_calls_on_two_models_equal_sequential_ones():
    """The lock serialises operations on the shared base: two threads training two models
    end where one thread running the same calls does."""
    results = {}
    for concurrent in (False, True):
        models = make_models()
        models.create("a", rank=4, seed=1)
        models.create("b", rank=4, seed=2)

        def train(model_id, seed, models=models):
            for step in range(3):
                models.forward_backward(model_id, batch(seed + step), "cross_entropy")
                models.optim_step(model_id, ADAM)

        if concurrent:
            threads = [threading.Thread(target=train, args=a) for a in (("a", 0), ("b", 50))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            train("a", 0)
            train("b", 50)
        results[concurrent] = [logprobs(models, m) for m in "ab"]
    for sequential, concurrent in zip(results[False], results[True], strict=True):
        for old, new in zip(sequential, concurrent, strict=True):
            assert np.array_equal(old, new)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda m: m.create("a", rank=4), "model_id"),
        (lambda m: m.create("z", rank=0), "lora_config.rank"),
        (lambda m: m.create("z", 4, None, False, False, False), "lora_config"),
        (lambda m: m.forward("nope", batch(), "cross_entropy"), "model_id"),
        (lambda m: m.forward_backward("a", batch(), "stable_reinforce"), "loss_fn"),
        (lambda m: m.optim_step("nope", ADAM), "model_id"),
        (lambda m: m.forward_backward("a", batch(), "ppo"), "data[0].loss_fn_inputs.logprobs"),
    ],
)
def test_user_mistakes_are_user_errors_naming_the_field(call, field):
    models = make_models()
    models.create("a", rank=4, seed=1)
    with pytest.raises(TinkerUserError) as caught:
        call(models)
    assert caught.value.field.endswith(field)

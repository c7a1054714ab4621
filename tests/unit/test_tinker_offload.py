"""Training models and sampler weights beyond `--max-resident-models` go to disk and come
back bit for bit (asyncgrpo.tinker.offload, asyncgrpo.tinker.snapshots): the LRU choice,
the round trip against models that never left memory, busy models kept, memory released,
files removed."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_tinker_training import ADAM, batch, make_models, rl_datum

from asyncgrpo.learning.trainer.datums import AdamParams
from asyncgrpo.tinker.errors import TinkerUserError
from asyncgrpo.tinker.lora_state import GRADIENT_PREFIX, OPTIMIZER_PREFIX, adapter_factors
from asyncgrpo.tinker.offload import LruOrder, ModelOffload, fresh_offload_dir
from asyncgrpo.tinker.snapshots import SnapshotCache

SPECS = {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2, train_unembed=False)}


def idle(model_ids) -> dict:
    """`SeqOrder`s of models with nothing queued."""
    return {m: SimpleNamespace(depth=0) for m in model_ids}


def offloaded_pair(tmp_path, limit: int = 1):
    models = make_models(budget=16)  # several micro-batches per call
    orders = idle(SPECS)
    keeper = ModelOffload(models, fresh_offload_dir(tmp_path), limit, orders)
    for model_id, spec in SPECS.items():
        models.create(model_id, **spec)
        keeper.added(model_id)
    return models, keeper, orders


def reference_pair():
    models = make_models(budget=16)
    for model_id, spec in SPECS.items():
        models.create(model_id, **spec)
    return models


def run_op(models, keeper, model_id: str, op: str, *args):
    """An operation as the service runs it: its model brought in first."""
    if keeper is not None:
        keeper.bring_in(model_id)
    return getattr(models, op)(model_id, *args)


def equal_outputs(x, y) -> bool:
    return x.metrics == y.metrics and all(
        torch.equal(torch.from_numpy(p), torch.from_numpy(q))
        for p, q in zip(x.logprobs, y.logprobs, strict=True)
    )


def test_lru_order_picks_the_least_recently_used_and_skips_the_spared():
    order = LruOrder()
    for key in "abcd":
        order.touch(key)
    order.touch("a")  # now b, c, d, a
    assert order.victims(2, lambda k: False) == ["b", "c"]
    assert order.victims(2, lambda k: k == "b") == ["c", "d"]
    assert order.victims(1, lambda k: k != "d") == ["d"]  # fewer: the rest are spared
    assert order.victims(4, lambda k: False) == []
    order.forget("c")
    assert list(order) == ["b", "d", "a"] and "c" not in order and len(order) == 3


def test_alternating_models_under_a_bound_of_one_match_models_that_never_left(tmp_path):
    models, keeper, _ = offloaded_pair(tmp_path)
    reference = reference_pair()
    assert models.resident_count() == 1 and keeper.offloaded == {"a"}
    for step in range(3):
        for model_id in SPECS:
            datums = batch(step) if model_id == "a" else [rl_datum(step), rl_datum(step + 9)]
            loss = "cross_entropy" if model_id == "a" else "ppo"
            got = run_op(models, keeper, model_id, "forward_backward", datums, loss)
            want = reference.forward_backward(model_id, datums, loss)
            assert equal_outputs(got, want)
            got = run_op(models, keeper, model_id, "optim_step", ADAM)
            assert got == reference.optim_step(model_id, ADAM)
            assert models.resident_count() == 1
    for model_id in SPECS:
        got = run_op(models, keeper, model_id, "forward", batch(7), "cross_entropy")
        assert equal_outputs(got, reference.forward(model_id, batch(7), "cross_entropy"))
        assert models.steps(model_id) == reference.steps(model_id) == 3
    assert keeper.offloads == 9 and keeper.reloads == 8  # at every switch of model


def test_pending_gradients_and_adam_state_travel_with_the_model(tmp_path):
    """Offloaded between its forward_backward and its optim_step, a model steps on the
    gradients it had, with the moments it had: the same step as one that stayed."""
    models, keeper, _ = offloaded_pair(tmp_path)
    reference = reference_pair()
    clipped = AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3)
    for target, keeper_of in ((models, keeper), (reference, None)):
        run_op(target, keeper_of, "a", "forward_backward", batch(), "cross_entropy")
        run_op(target, keeper_of, "a", "optim_step", ADAM)
        run_op(target, keeper_of, "a", "forward_backward", batch(3), "cross_entropy")
    # "a" leaves with its pending gradients
    run_op(models, keeper, "b", "forward", batch(), "cross_entropy")
    saved = load_file(keeper.file_of("a"))
    assert any(name.startswith(GRADIENT_PREFIX) for name in saved)
    assert any(name.startswith(OPTIMIZER_PREFIX) for name in saved)
    assert run_op(models, keeper, "a", "optim_step", clipped) == reference.optim_step("a", clipped)
    for name, param in adapter_factors(models.peft_model, models.models["a"].adapter).items():
        want = adapter_factors(reference.peft_model, reference.models["a"].adapter)[name]
        assert torch.equal(param, want)
    state, want = models.state("a"), reference.state("a")
    assert state.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(t, want.tensors[k]) for k, t in state.tensors.items())


def test_a_busy_model_stays_and_the_next_idle_one_goes(tmp_path):
    models, keeper, orders = offloaded_pair(tmp_path, limit=2)
    models.create("c", rank=4, seed=3)
    orders["c"] = SimpleNamespace(depth=0)
    orders["a"].depth = 1  # "a", the least recently used, has an operation queued
    keeper.added("c")
    assert keeper.offloaded == {"b"} and models.is_resident("a")
    orders["a"].depth = orders["c"].depth = 1
    keeper.bring_in("b")  # every other model busy: over the bound for now
    assert models.resident_count() == 3 and not keeper.offloaded
    orders["a"].depth = orders["c"].depth = 0
    keeper.bring_in("b")  # the next operation takes the excess out
    assert keeper.offloaded == {"a"} and models.resident_count() == 2


def test_an_offloaded_model_frees_its_memory_and_its_file_goes_with_it(tmp_path):
    models, keeper, _ = offloaded_pair(tmp_path, limit=2)
    run_op(models, keeper, "a", "forward_backward", batch(), "cross_entropy")
    run_op(models, keeper, "a", "optim_step", ADAM)
    factor = weakref.ref(next(iter(adapter_factors(models.peft_model, "tinker_0").values())))
    optimizer = weakref.ref(models.models["a"].trainer.optimizer)
    run_op(models, keeper, "b", "forward", batch(), "cross_entropy")  # "a": least recent
    models.create("c", rank=4, seed=3)
    keeper.added("c")
    gc.collect()
    assert factor() is None and optimizer() is None
    assert "tinker_0" not in models.peft_model.peft_config
    assert keeper.file_of("a").is_file() and models.steps("a") == 1
    with pytest.raises(RuntimeError, match="offloaded"):
        models.forward("a", batch(), "cross_entropy")  # only through bring_in
    keeper.forget("a")
    models.remove("a")
    assert not keeper.file_of("a").exists() and "a" not in models.models
    assert not keeper.offloaded


def test_a_model_comes_back_onto_a_base_left_without_adapters(tmp_path):
    """The resident model's session ended while the other was out: peft holds no adapter
    when the offloaded one comes back."""
    models, keeper, _ = offloaded_pair(tmp_path)
    reference = reference_pair()
    keeper.forget("b")
    models.remove("b")
    assert not models.peft_model.peft_config
    got = run_op(models, keeper, "a", "forward", batch(), "cross_entropy")
    assert equal_outputs(got, reference.forward("a", batch(), "cross_entropy"))


def test_unbounded_keeps_everything_and_writes_nothing(tmp_path):
    models = make_models()
    keeper = ModelOffload(models, fresh_offload_dir(tmp_path), None, {})
    for model_id, spec in SPECS.items():
        models.create(model_id, **spec)
        keeper.added(model_id)
        keeper.bring_in(model_id)
    assert models.resident_count() == 2 and not any((tmp_path / "offloaded").iterdir())


def test_a_start_empties_what_the_process_before_left(tmp_path):
    left = tmp_path / "offloaded" / "model-s_train_0.safetensors"
    left.parent.mkdir()
    left.write_bytes(b"old")
    assert fresh_offload_dir(tmp_path) == left.parent and not left.exists()


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("z.lora_B.weight", torch.randn(6, 2, generator=g)),
        ("a.lora_A.weight", torch.randn(2, 6, generator=g)),
    ]


def test_sampler_weights_beyond_the_bound_wait_on_disk_and_come_back_exactly(tmp_path):
    cache = SnapshotCache(fresh_offload_dir(tmp_path), limit=1)
    first, second = cache.add(weights(0)), cache.add(weights(1))
    assert not first.resident and second.resident and cache.offloaded_count() == 1
    for (name, got), (want_name, want) in zip(first.tensors(), weights(0), strict=True):
        assert name == want_name and torch.equal(got, want)  # read for this use alone
    assert not first.resident
    cache.use(first)
    assert first.resident and not second.resident and (cache.offloads, cache.reloads) == (2, 1)
    files = sorted(p.name for p in (tmp_path / "offloaded").iterdir())
    assert files == ["snapshot-1.safetensors", "snapshot-2.safetensors"]
    del second  # the last sampler holding it is gone: so is its file
    gc.collect()
    assert [p.name for p in (tmp_path / "offloaded").iterdir()] == ["snapshot-1.safetensors"]
    third = cache.add(weights(2))  # "first" goes again, without writing its file again
    assert not first.resident and third.resident and cache.offloaded_count() == 1


def test_sampler_weights_without_a_bound_stay(tmp_path):
    cache = SnapshotCache(fresh_offload_dir(tmp_path), limit=None)
    sets = [cache.add(weights(i)) for i in range(3)]
    assert all(s.resident for s in sets) and cache.offloaded_count() == 0


def test_the_bound_is_a_command_line_option_handed_to_the_service(monkeypatch, capsys):
    from asyncgrpo.tinker import build, serve

    parser = serve.build_parser()
    assert parser.parse_args([]).max_resident_models is None
    args = parser.parse_args(["--max-resident-models", "2"])
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-resident-models", bad])
    assert "--max-resident-models" in capsys.readouterr().err
    given = {}
    monkeypatch.setattr(build, "build_service", lambda *a, **options: given.update(options))
    serve._build(args, Path("model"), None)
    assert given["max_resident_models"] == 2


def test_an_operation_of_a_model_that_left_counts_nothing(tmp_path):
    models, keeper, _ = offloaded_pair(tmp_path)
    keeper.forget("b")
    models.remove("b")
    with pytest.raises(TinkerUserError, match="no model"):
        run_op(models, keeper, "b", "forward", batch(), "cross_entropy")
    run_op(models, keeper, "a", "forward", batch(), "cross_entropy")  # the bound still works
    assert models.is_resident("a") and not keeper.offloaded

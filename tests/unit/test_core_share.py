"""The trainer borrows the engine's threads while the engine idles (`core_share.py`)."""

import asyncio
import gc
import time

import pytest
import torch

from asyncgrpo.base.config import EmbeddedEngineConfig, RunConfig
from asyncgrpo.inference.core_share import (
    BUSY_FILE_ENV,
    BusyFlag,
    ThreadLender,
    Unshared,
    may_borrow,
)
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import SamplingParams
from asyncgrpo.testing import build_tiny_llama


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_flag_is_shared_through_its_file_and_removed_with_its_creator(monkeypatch):
    flag = BusyFlag.create()
    path = flag.path
    monkeypatch.setenv(BUSY_FILE_ENV, str(path))
    reader = BusyFlag.from_env()
    assert not reader.busy
    flag.set(True)
    assert reader.busy
    flag.set(False)
    assert not reader.busy
    del flag
    gc.collect()
    assert not path.exists()
    assert isinstance(BusyFlag.from_env(), Unshared)  # the trainer is gone
    monkeypatch.delenv(BUSY_FILE_ENV)
    unshared = BusyFlag.from_env()  # no trainer borrows: setting it does nothing
    unshared.set(True)
    assert isinstance(unshared, Unshared) and not unshared.busy


def test_the_trainer_runs_wide_only_while_the_engine_idles(threads):
    model = build_tiny_llama(64, num_layers=2, seed=0)
    flag = BusyFlag.create()
    lender = ThreadLender(flag, narrow=1, wide=2)
    assert lender.install(model) == 2
    seen: list[tuple[str, int]] = []

    def record_forward(module, args, output):
        seen.append(("forward", torch.get_num_threads()))
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda g: seen.append(("backward", torch.get_num_threads())))

    for layer in model.model.layers:
        layer.register_forward_hook(record_forward)  # after the lender's hooks
    ids = torch.randint(0, 64, (1, 6))
    for busy, want in ((False, 2), (True, 1)):
        flag.set(busy)
        seen.clear()
        model(input_ids=ids).logits.sum().backward()
        assert [kind for kind, _ in seen] == ["forward"] * 2 + ["backward"] * 2
        assert all(n == want for _, n in seen), (busy, seen)
    flag.set(False)
    lender.remove()
    assert torch.get_num_threads() == 1
    seen.clear()
    torch.set_num_threads(1)
    model(input_ids=ids).logits.sum().backward()
    assert all(n == 1 for _, n in seen)  # no hooks left


def test_borrowing_applies_to_one_local_embedded_engine_and_one_trainer_process():
    def cfg(**sections):
        return RunConfig(rewards=["asyncgrpo.testing.even_token_reward"], **sections)

    assert may_borrow(cfg())
    assert not may_borrow(cfg(trainer={"borrow_engine_threads": False}))
    assert not may_borrow(cfg(trainer={"num_processes": 2}))
    assert not may_borrow(cfg(engine={"replicas": 2}))
    assert not may_borrow(cfg(engine={"type": "external", "base_url": "http://127.0.0.1:1"}))


def engine_recording_busy(model_dir, monkeypatch, part: str, method: str):
    """An engine sharing a fresh flag, and the flag's value at each call of `part.method`
    (`part`: an attribute of the engine); the engine is not started."""
    flag = BusyFlag.create()
    monkeypatch.setenv(BUSY_FILE_ENV, str(flag.path))
    engine = Engine(EmbeddedEngineConfig(model=str(model_dir), dtype="float32"))
    during: list[bool] = []
    target = getattr(engine, part)
    original = getattr(target, method)

    def recording(*args, **kwargs):
        during.append(flag.busy)
        return original(*args, **kwargs)

    setattr(target, method, recording)
    return engine, flag, during


def test_the_engine_publishes_busy_while_it_computes(tiny_model_dir, monkeypatch):
    engine, flag, during = engine_recording_busy(tiny_model_dir, monkeypatch, "scheduler", "step")
    engine.start()
    try:

        async def generate():
            params = SamplingParams(max_tokens=8, n=2, temperature=1.0)
            return [d async for d in engine.generate([1, 2, 3], params)]

        assert asyncio.run(generate())
        assert during and all(during)
        for _ in range(200):  # the engine thread clears it once nothing is left to do
            if not flag.busy:
                break
            time.sleep(0.01)
        assert not flag.busy
    finally:
        engine.shutdown()


def test_the_engine_publishes_busy_while_it_writes_a_weight_update_when_paused(
    tiny_model_dir, monkeypatch
):
    """A weight sync that lands while the trainer steps (`run/session/engine_link.py`) copies
    the weights on the engine's core: the trainer must not count that core as idle."""
    engine, _, during = engine_recording_busy(
        tiny_model_dir, monkeypatch, "runner", "weights_changed"
    )
    engine.start()
    try:

        async def update():
            await engine.pause("keep")
            name, param = next(iter(engine.model.named_parameters()))
            await engine.update_weights([(name, param.detach() + 1)], version=1)
            await engine.resume()

        asyncio.run(update())
        assert during == [True]
    finally:
        engine.shutdown()

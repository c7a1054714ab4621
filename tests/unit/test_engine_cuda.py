"""The whole engine on a device: the default CPU engine's greedy tokens, before and after
weight updates, from an engine on a paged KV cache attended with FlexAttention.

One test, two devices. `cpu` runs everywhere: the engine with `kv_cache: paged,
paged_attention: flex` (FlexAttention run eagerly) against the default slot engine,
the code a CUDA engine runs, on the CPU. `cuda` is marked `gpu` and skipped without a
CUDA device: `engine.device: cuda` behind its experimental gate, so the model, the
pools and sampling live on the GPU and FlexAttention is compiled (Triton). Both decode
32 greedy tokens for prompts of several lengths (one longer than a prefill chunk) in
float32 (TF32 off), then take a full weight update and a LoRA adapter sent from the CPU:
each must land in the device's tensors and give the reference engine's tokens again.
The model has head_dim 64: Triton's flex kernels need 16 or more.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.config.engine import EXPERIMENTAL_CUDA_ENV
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.paged.runner import PagedModelRunner
from asyncgrpo.inference.engine.types import SamplingParams
from asyncgrpo.testing import save_tiny_model_dir

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
TOKENS = 32
UPDATED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
ADAPTED = "model.layers.1.self_attn.v_proj"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-d64"), hidden_size=256, num_heads=4, num_kv_heads=2,
        intermediate_size=512, max_position_embeddings=1024,
    )  # fmt: skip


@pytest.fixture
def on(request, monkeypatch):
    """The device of the test's parameter, with the CUDA engine let through and TF32 off."""
    device = request.param
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        monkeypatch.setenv(EXPERIMENTAL_CUDA_ENV, "1")
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        request.addfinalizer(lambda: torch.set_float32_matmul_precision(before))
    return device


def _engine(model_dir, **settings) -> Engine:
    config = EmbeddedEngineConfig(
        model=str(model_dir), dtype="float32", max_num_seqs=4, prefill_chunk_size=32, **settings
    )
    engine = Engine(config)
    engine.start()
    return engine


def _prompts(vocab: int) -> list[list[int]]:
    lengths = (5, 17, 40, 70)  # 40 and 70: prefilled in chunks of 32, 70 across blocks
    return [[(7 + 13 * i + 5 * n) % (vocab - 3) + 3 for i in range(n)] for n in lengths]


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        ids: list[int] = []
        async for delta in engine.generate(prompt, params):
            ids += delta.token_ids
        return ids

    async def every():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(every())


def _full_update(engine: Engine) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for name in UPDATED:
        weight = engine._params[name].detach().cpu()
        out.append((name, weight + 0.05 * torch.randn(weight.shape, generator=gen)))
    return out


def _adapter(engine: Engine, rank: int = 4) -> list[tuple[str, torch.Tensor]]:
    out_dim, in_dim = engine._params[f"{ADAPTED}.weight"].shape
    gen = torch.Generator().manual_seed(2)
    prefix = f"base_model.model.{ADAPTED}"
    return [
        (f"{prefix}.lora_A.weight", 0.3 * torch.randn(rank, in_dim, generator=gen)),
        (f"{prefix}.lora_B.weight", 0.3 * torch.randn(out_dim, rank, generator=gen)),
    ]


def _on_device(engine: Engine, device: str) -> None:
    runner = engine.runner
    assert engine.device.type == device and runner.device.type == device
    assert isinstance(runner, PagedModelRunner) and runner.attention == "flex"
    assert runner.cache.keys.device.type == device
    assert all(p.device.type == device for p in engine.model.parameters())


@pytest.mark.parametrize("on", DEVICES, indirect=True)
def test_the_engine_on_a_device_decodes_the_cpu_engines_greedy_tokens(on, model_dir):
    reference = _engine(model_dir)  # the CPU's slot cache
    engine = _engine(model_dir, device=on, kv_cache="paged", paged_attention="flex")
    try:
        _on_device(engine, on)
        prompts = _prompts(engine.vocab_size)
        first = _greedy(reference, prompts)
        assert _greedy(engine, prompts) == first
        assert all(len(ids) == TOKENS for ids in first)

        update = _full_update(reference)
        for target in (reference, engine):
            asyncio.run(target.update_weights(update, version=1))
        for name, value in update:
            assert engine._params[name].device.type == on
            torch.testing.assert_close(engine._params[name].cpu(), value, rtol=0, atol=0)
        second = _greedy(reference, prompts)
        assert second != first  # the update changed what is sampled
        assert _greedy(engine, prompts) == second

        adapter = _adapter(reference)
        for target in (reference, engine):
            asyncio.run(target.update_weights(adapter, version=2))
        third = _greedy(reference, prompts)
        assert third != second
        assert _greedy(engine, prompts) == third
        _on_device(engine, on)
    finally:
        engine.shutdown()
        reference.shutdown()

"""`trainer.compile_layers`: the decoder layers run compiled and give the gradients eager
ones do (float64: only the order of fused sums differs), with a LoRA adapter too; and
`auto` resolves where it should."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.base.config import ConfigError, RunConfig, TrainerConfig
from asyncgrpo.learning.trainer import compiled_layers
from asyncgrpo.learning.trainer.build import load_policy, policy_trainer
from asyncgrpo.testing import save_tiny_model_dir
from tests.unit.test_gradient_checkpointing import groups

needs_compiler = pytest.mark.skipif(
    not compiled_layers.cpp_compiler_found(), reason="inductor's CPU kernels need g++"
)


def full_precision_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm in the input's dtype: transformers' rounds to float32 first, which a
    fused kernel skips, and which would hide float64's agreement."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def gradients(model_dir, compile_layers: bool, **settings) -> tuple[dict, int]:
    """The GRPO loss's float64 gradients over a batch, and how many graphs dynamo compiled."""
    from torch._dynamo.utils import counters

    lora = settings.pop("lora", None)
    cfg = RunConfig(
        model={"name_or_path": str(model_dir), "lora": lora},
        trainer={"compile_layers": compile_layers, "bf16_autocast": False, **settings},
        rewards=["asyncgrpo.testing.even_token_reward"],
    )
    torch.manual_seed(0)  # the same LoRA initialisation for both runs
    model = load_policy(cfg, str(model_dir)).double()
    before = counters["stats"]["unique_graphs"]
    trainer = policy_trainer(cfg, model)
    trainer.accumulate(trainer.prepare(groups()))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, counters["stats"]["unique_graphs"] - before


@needs_compiler
@pytest.mark.parametrize(
    "settings",
    [{}, {"lora": {"r": 4, "alpha": 8.0}}],
    ids=["plain", "lora"],
)
def test_compiled_layers_give_the_eager_gradients(tmp_path, monkeypatch, settings):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "forward", full_precision_norm)
    torch._dynamo.reset()  # graphs cached by an earlier test would compile nothing here
    model_dir = save_tiny_model_dir(tmp_path / "model")
    eager, eager_graphs = gradients(model_dir, False, **settings)
    compiled, compiled_graphs = gradients(model_dir, True, **settings)
    assert eager_graphs == 0 < compiled_graphs
    assert eager.keys() == compiled.keys() and eager
    for name, want in eager.items():
        torch.testing.assert_close(compiled[name], want, atol=1e-12, rtol=1e-9, msg=name)


def test_auto_compiles_one_bf16_cpu_process_on_wide_models_only():
    auto = TrainerConfig()
    wide = compiled_layers.COMPILE_MIN_HIDDEN
    found = compiled_layers.cpp_compiler_found()
    assert compiled_layers.wanted(auto, "cpu", wide, 1, bf16=True) is found
    assert not compiled_layers.wanted(auto, "cpu", wide - 1, 1, bf16=True)
    assert not compiled_layers.wanted(auto, "cpu", wide, 2, bf16=True)
    assert not compiled_layers.wanted(auto, "cuda", wide, 1, bf16=True)
    assert not compiled_layers.wanted(
        TrainerConfig(compile_layers=False), "cpu", wide, 1, bf16=True
    )
    checkpointed = TrainerConfig(gradient_checkpointing=True)
    assert not compiled_layers.wanted(checkpointed, "cpu", wide, 1, bf16=True)
    assert not compiled_layers.wanted(auto, "cpu", wide, 1, bf16=False)  # slower in float32
    assert (
        compiled_layers.wanted(TrainerConfig(compile_layers=True), "cpu", 64, 1, bf16=False)
        is found
    )


def test_compile_layers_true_where_unmeasured_is_a_clear_error():
    on = TrainerConfig(compile_layers=True)
    with pytest.raises(ConfigError, match="not yet on 2 process"):
        compiled_layers.wanted(on, "cpu", 64, 2, bf16=True)
    with pytest.raises(ConfigError, match="on cuda"):
        compiled_layers.wanted(on, "cuda", 64, 1, bf16=True)
    checkpointed = TrainerConfig(compile_layers=True, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        compiled_layers.wanted(checkpointed, "cpu", 64, 1, bf16=True)


def test_compile_layers_true_without_a_compiler_says_so(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ConfigError, match="needs a C.. compiler"):
        compiled_layers.wanted(TrainerConfig(compile_layers=True), "cpu", 64, 1, bf16=True)

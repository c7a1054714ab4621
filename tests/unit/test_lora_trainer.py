"""LoRA on the trainer side: what trains, what a sync publishes, and that it is peft's math.

The published factors are checked against peft's own `merge_and_unload` (an independent
reference for W + (alpha/r) B A) and against sizes computed by hand from the layer shapes.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from asyncgrpo.base.config import (
    AdvantageConfig,
    ConfigError,
    LoraConfig,
    LossConfig,
    TrainerConfig,
)
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.lora import (
    adapter_nbytes,
    adapter_weights,
    apply_lora,
    base_weight_name,
    is_lora,
    published_weights,
)
from asyncgrpo.testing import build_tiny_llama

pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_model(r: int = 4, alpha: float = 12.0, targets=ATTENTION, randomize_b: bool = True):
    """The tiny llama (hidden 64, 4 heads of 16, 2 kv heads, 2 layers) with an adapter;
    B is zero at init, so tests that need a non-trivial update randomise it."""
    model = apply_lora(
        build_tiny_llama(64, seed=3), LoraConfig(r=r, alpha=alpha, target_modules=targets)
    )
    if randomize_b:
        torch.manual_seed(7)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)
    return model


def test_only_adapter_parameters_require_grad():
    model = lora_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    # 2 layers x 4 projections x (A, B)
    assert len(trainable) == 16
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert is_lora(model) and not is_lora(build_tiny_llama(64))


def test_all_linear_targets_every_linear_layer_but_the_output_head():
    model = apply_lora(build_tiny_llama(64), LoraConfig(target_modules="all-linear"))
    adapted = {base_weight_name(n).split(".")[-2] for n, _ in adapter_weights(model)}
    assert adapted == {*ATTENTION, "gate_proj", "up_proj", "down_proj"}


def test_target_matching_nothing_lists_the_linear_modules():
    with pytest.raises(ConfigError) as err:
        apply_lora(build_tiny_llama(64), LoraConfig(target_modules=["q_proj", "qkv_proj"]))
    message = str(err.value)
    assert "'qkv_proj'" in message
    for name in ("q_proj", "o_proj", "gate_proj", "down_proj", "lm_head"):
        assert name in message


def test_non_linear_target_is_refused():
    with pytest.raises(ConfigError, match="not a linear module"):
        apply_lora(build_tiny_llama(64), LoraConfig(target_modules=["embed_tokens"]))


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncgrpo\[peft\]'"):
        apply_lora(build_tiny_llama(64), LoraConfig())


def test_published_pairs_reproduce_peft_merge():
    model = lora_model(r=4, alpha=12.0)  # alpha/r = 3: a forgotten scale would show
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    published = dict(published_weights(model))
    a_names = [n for n in published if n.endswith(".lora_A.weight")]
    assert len(a_names) == 8 and len(published) == 16
    for a_name in a_names:
        b_name = a_name.replace(".lora_A.", ".lora_B.")
        target = base_weight_name(a_name)
        layer = model.get_submodule(a_name.removesuffix(".lora_A.weight"))
        base = layer.base_layer.weight.detach()
        assert published[a_name].shape == (4, base.shape[1])
        assert published[b_name].shape == (base.shape[0], 4)
        update = published[b_name] @ published[a_name]
        torch.testing.assert_close(base + update, merged[target], atol=1e-6, rtol=0)
        assert update.abs().max() > 1e-3  # the check above is not vacuous


def test_published_tensors_are_copies_cast_to_dtype():
    model = lora_model()
    assert {t.dtype for _, t in published_weights(model, torch.bfloat16)} == {torch.bfloat16}
    published = dict(published_weights(model))
    before = {name: t.clone() for name, t in published.items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert all(torch.equal(published[name], before[name]) for name in published)


def test_published_bytes_are_the_adapters_size():
    model = lora_model(r=4)
    # by hand, per layer: q 64->64, k 64->32, v 64->32, o 64->64; r * (in + out) each
    params_per_layer = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64))
    expected = 2 * params_per_layer * 4  # 2 layers, fp32
    published = sum(t.numel() * t.element_size() for _, t in published_weights(model))
    assert published == expected == adapter_nbytes(model)
    assert adapter_nbytes(model, torch.bfloat16) == expected // 2
    plain = build_tiny_llama(64)
    full = sum(t.numel() * t.element_size() for _, t in published_weights(plain))
    assert full == sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    assert published * 10 < full


def test_full_model_publishes_its_state_dict():
    model = build_tiny_llama(64)
    published = dict(published_weights(model))
    assert list(published) == list(model.state_dict())
    assert all(torch.equal(published[k], v) for k, v in model.state_dict().items())


def groups_by_hand() -> list[Group]:
    """Two prompts, four samples each, rewards that vary inside each group."""
    groups = []
    for g in range(2):
        rollouts = [
            Rollout(
                [1, 2, 3 + g],
                [4 + i, 5, 6 + g, 7],
                [-2.0] * 4,
                [0] * 4,
                "stop",
                "",
                rewards=[float(i % 2 + g)],
            )
            for i in range(4)
        ]
        groups.append(Group(g, {}, rollouts))
    return groups


def test_trainer_step_changes_only_the_adapter():
    from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer

    model = lora_model(randomize_b=False)  # as training starts: B = 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = PolicyTrainer(
        model,
        TrainerConfig(learning_rate=1e-2, bf16_autocast=False),
        LossConfig(),
        AdvantageConfig(),
        max_steps=10,
    )
    for _ in range(2):  # the second step moves A too (its gradient is zero while B = 0)
        trainer.step(groups_by_hand())
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name
    assert sum(not p.requires_grad for p in model.parameters()) > 0

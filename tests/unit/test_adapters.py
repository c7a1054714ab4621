"""The LoRA adapter convention and merge (`asyncgrpo.inference.adapters`) against hand-built tensors,
and against peft itself: its saved names pair up, and it loads what we write."""

import json

import pytest
import torch

from asyncgrpo.inference.adapters import (
    AdapterError,
    AdapterMerge,
    adapter_pairs,
    base_weight_name,
    check_against,
    is_adapter_update,
    save_peft_adapter,
)

Q = "base_model.model.model.layers.0.self_attn.q_proj"
V = "base_model.model.model.layers.0.self_attn.v_proj"


def named(module: str, a, b) -> list[tuple[str, torch.Tensor]]:
    return [
        (module + ".lora_A.weight", torch.tensor(a, dtype=torch.float32)),
        (module + ".lora_B.weight", torch.tensor(b, dtype=torch.float32)),
    ]


def test_names_map_to_their_base_weight():
    assert base_weight_name(Q + ".lora_A.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert base_weight_name(V + ".lora_B.weight") == "model.layers.0.self_attn.v_proj.weight"
    assert is_adapter_update([Q + ".lora_A.weight", Q + ".lora_B.weight"])
    assert not is_adapter_update(["model.embed_tokens.weight", "lm_head.weight"])


@pytest.mark.parametrize(
    "names, message",
    [
        ([Q + ".lora_A.weight", "model.norm.weight"], "mixes adapter tensors"),
        (["model.layers.0.self_attn.q_proj.lora_A.weight"], "must be named as peft saves it"),
        ([Q + ".lora_A.default.weight"], "without the adapter name"),
        (["base_model.model.model.embed_tokens.lora_embedding_A"], "embedding"),
    ],
)
def test_malformed_names_are_refused_with_the_reason(names, message):
    with pytest.raises(AdapterError, match=message):
        assert is_adapter_update(names)
        adapter_pairs((name, torch.zeros(1, 1)) for name in names)


def test_pairs_need_both_factors_once_with_matching_rank():
    with pytest.raises(AdapterError, match="has no lora_B"):
        adapter_pairs(named(Q, [[1.0, 0.0]], [[1.0], [1.0]])[:1])
    with pytest.raises(AdapterError, match="sent twice"):
        adapter_pairs(named(Q, [[1.0, 0.0]], [[1.0], [1.0]]) * 2)
    with pytest.raises(AdapterError, match=r"must be \(r, in\) and \(out, r\)"):
        adapter_pairs(named(Q, [[1.0, 0.0]], [[1.0, 2.0], [1.0, 2.0]]))
    with pytest.raises(AdapterError, match="floating-point"):
        adapter_pairs(
            [
                (Q + ".lora_A.weight", torch.ones(1, 2, dtype=torch.long)),
                (Q + ".lora_B.weight", torch.ones(2, 1)),
            ]
        )


def test_pairs_are_checked_against_the_weights_they_update():
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
        "model.layers.0.self_attn.v_proj.weight": torch.zeros(3, 2),
    }
    good = adapter_pairs(named(Q, [[1.0, 0.0]], [[1.0], [1.0]]))
    check_against(good, weights)  # (2, 1) @ (1, 2) fits (2, 2)
    with pytest.raises(AdapterError, match=r"B @ A is \(2, 2\) but .* is \(3, 2\)"):
        check_against(adapter_pairs(named(V, [[1.0, 0.0]], [[1.0], [1.0]])), weights)
    lost = "base_model.model.model.layers.9.self_attn.q_proj"
    with pytest.raises(AdapterError, match="names no weight of the model"):
        check_against(adapter_pairs(named(lost, [[1.0, 0.0]], [[1.0], [1.0]])), weights)
    with pytest.raises(AdapterError, match="tied to another weight"):
        check_against(good, weights, tied={"model.layers.0.self_attn.q_proj.weight"})


def test_merge_sets_base_plus_b_a_and_never_accumulates():
    q = "model.layers.0.self_attn.q_proj.weight"
    v = "model.layers.0.self_attn.v_proj.weight"
    weights = {q: torch.tensor([[1.0, 2.0], [3.0, 4.0]]), v: torch.tensor([[5.0, 6.0]])}
    merge = AdapterMerge(weights, torch.float32)

    def apply(named_tensors):
        writes = dict(merge.merged(adapter_pairs(named_tensors)))
        for name, value in writes.items():
            weights[name].copy_(value)
        return writes

    # B @ A = [[2], [3]] @ [[1, 0]] = [[2, 0], [3, 0]]; [[1]] @ [[0, 1]] = [[0, 1]]
    apply(named(Q, [[1.0, 0.0]], [[2.0], [3.0]]) + named(V, [[0.0, 1.0]], [[1.0]]))
    assert weights[q].tolist() == [[3.0, 2.0], [6.0, 4.0]]
    assert weights[v].tolist() == [[5.0, 7.0]]
    # a second adapter starts from the base again; v, not in it, goes back to its base
    writes = apply(named(Q, [[0.0, 1.0]], [[1.0], [-1.0]]))
    assert weights[q].tolist() == [[1.0, 3.0], [3.0, 3.0]]
    assert weights[v].tolist() == [[5.0, 6.0]]
    assert set(writes) == {q, v}
    # a full update of q makes its new value the base of the next merge
    weights[q].copy_(torch.zeros(2, 2))
    merge.forget([q])
    apply(named(Q, [[1.0, 1.0]], [[1.0], [0.0]]))
    assert weights[q].tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_bf16_merges_round_once_from_an_exact_base_copy():
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.manual_seed(0)
    base = torch.randn(8, 8).to(torch.bfloat16)
    weights = {name: base.clone()}
    merge = AdapterMerge(weights, torch.bfloat16)
    a, b = torch.randn(2, 8) * 1e-3, torch.randn(8, 2) * 1e-3
    pairs = adapter_pairs([(Q + ".lora_A.weight", a), (Q + ".lora_B.weight", b)])
    results = []
    for _ in range(5):
        (_, value), *_ = merge.merged(pairs)
        weights[name].copy_(value.to(torch.bfloat16))
        results.append(weights[name].clone())
    assert merge.bases[name].dtype == torch.bfloat16
    assert torch.equal(merge.bases[name], base)
    expected = (base.float() + b @ a).to(torch.bfloat16)  # a plain loop would agree
    assert all(torch.equal(r, expected) for r in results)


def tiny_peft_model(seed: int):
    peft = pytest.importorskip("peft")
    from asyncgrpo.testing import build_tiny_llama

    model = build_tiny_llama(64, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    wrapped = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return wrapped


def published(wrapped) -> list[tuple[str, torch.Tensor]]:
    """The adapter as the trainer publishes it: peft's saved names, alpha / r baked into B."""
    from peft import get_peft_model_state_dict

    scale = 8 / 4
    return [
        (name, tensor * scale if ".lora_B." in name else tensor)
        for name, tensor in get_peft_model_state_dict(wrapped).items()
    ]


def test_peft_saved_names_pair_up_and_merge_like_peft():
    wrapped = tiny_peft_model(seed=1)
    pairs = adapter_pairs(published(wrapped))
    assert len(pairs) == 2 * 3  # two layers, q/k/v
    base = {k: v.clone() for k, v in wrapped.get_base_model().state_dict().items()}
    base = {k.replace(".base_layer", ""): v for k, v in base.items() if "lora_" not in k}
    check_against(pairs, base)
    merged = dict(AdapterMerge(base, torch.float32).merged(pairs))
    reference = wrapped.merge_and_unload().state_dict()
    for name, value in merged.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6)


def test_saved_adapter_directory_loads_in_peft_with_the_same_merge(tmp_path):
    wrapped = tiny_peft_model(seed=2)  # skips without peft
    from peft import PeftModel

    from asyncgrpo.testing import build_tiny_llama

    expected = {k: v.clone() for k, v in wrapped.merge_and_unload().state_dict().items()}
    pairs = adapter_pairs(published(tiny_peft_model(seed=2)))
    directory = save_peft_adapter(pairs, tmp_path / "asyncgrpo-v3")
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4
    assert config["target_modules"] == ["k_proj", "q_proj", "v_proj"]
    assert not (tmp_path / "asyncgrpo-v3.partial").exists()
    base = build_tiny_llama(64, hidden_size=32, num_heads=2, num_kv_heads=1, seed=0)
    loaded = PeftModel.from_pretrained(base, directory).merge_and_unload().state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-6)


def test_adapters_of_different_ranks_are_not_saved(tmp_path):
    pairs = adapter_pairs(
        named(Q, [[1.0, 0.0]], [[1.0], [1.0]]) + named(V, [[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0]])
    )
    with pytest.raises(AdapterError, match="ranks differ"):
        save_peft_adapter(pairs, tmp_path / "a")


def test_vllm_backend_tells_adapters_from_full_images_without_reading_an_image():
    from asyncgrpo.inference.vllm.lora import adapter_or_weights

    def image():
        yield "model.embed_tokens.weight", torch.zeros(2)
        yield "model.norm.weight", torch.zeros(2)

    weights, adapter = adapter_or_weights(image())
    assert not adapter and [name for name, _ in weights] == [
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]  # the generator's first item was peeked at, not lost
    pairs = named(Q, [[1.0, 0.0]], [[1.0], [1.0]])
    weights, adapter = adapter_or_weights(iter(pairs))
    assert adapter and weights == pairs
    with pytest.raises(AdapterError, match="mixes adapter tensors"):
        adapter_or_weights(pairs + [("model.norm.weight", torch.zeros(2))])


def test_vllm_lora_rank_rounds_up_to_a_rank_vllm_serves():
    from asyncgrpo.base.config import ConfigError, VLLMEngineConfig
    from asyncgrpo.inference.vllm.launcher import lora_arguments, vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [
        1,
        8,
        8,
        16,
        16,
        320,
        512,
    ]
    with pytest.raises(ConfigError, match="up to 512"):
        vllm_lora_rank(513)
    assert lora_arguments(VLLMEngineConfig(max_lora_rank=4)) == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras",
        "2",
    ]
    assert lora_arguments(VLLMEngineConfig()) == []

"""Adapter-only syncs into a real embedded engine process (`EmbeddedBackend`, shm, HTTP).

The trainer publishes a LoRA adapter (peft's saved names, alpha / r baked into
lora_B); the engine must then sample exactly as the merged model does. The
reference is computed independently: peft's `merge_and_unload()` on a
transformers copy with the same adapter, decoded greedily by a plain argmax loop.
A second adapter must replace the first, not add to it; malformed adapters are
refused and change nothing.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.inference.backend.embedded import EmbeddedBackend
from asyncgrpo.inference.client import EngineRefused

peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOKENS = 12


def lora_model(model_dir, seed: int):
    """The tiny model wrapped by peft, with random (nonzero) lora_B of seed `seed`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    wrapped = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    return wrapped


def published(wrapped) -> list[tuple[str, torch.Tensor]]:
    """What the trainer sends: the adapter state under peft's names, the scale in B."""
    state = peft.get_peft_model_state_dict(wrapped)
    scale = ALPHA / RANK
    return [(k, v * scale if ".lora_B." in k else v.clone()) for k, v in state.items()]


def stacked_model(model_dir, first: int, second: int):
    """The tiny model with adapter `second` merged on top of adapter `first` (accumulated)."""
    stacked = lora_model(model_dir, first).merge_and_unload()
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    stacked = peft.get_peft_model(stacked, config)
    second_state = peft.get_peft_model_state_dict(lora_model(model_dir, second))
    peft.set_peft_model_state_dict(stacked, second_state)
    return stacked.merge_and_unload()


def greedy_reference(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def logprobs_reference(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread("lora-tests")
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, loop):
    cfg = EmbeddedEngineConfig(
        model=str(tiny_model_dir), dtype="float32", num_threads=1, max_num_seqs=4
    )
    backend = EmbeddedBackend(cfg)
    try:
        loop.run(backend.wait_ready())
        yield backend
    finally:
        loop.run(backend.close(), timeout=60)


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir).encode("What is 12 + 7?")


async def greedy_and_sampled(backend, prompt, seed: int):
    client = backend.client
    greedy = await client.complete(prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True)
    sampled = await client.complete(prompt, max_tokens=TOKENS, seed=seed, ignore_eos=True)
    return greedy.samples[0], sampled.samples[0]


def test_adapter_syncs_sample_as_the_merged_model_and_do_not_accumulate(
    engine, loop, prompt, tiny_model_dir
):
    base_greedy, _ = loop.run(greedy_and_sampled(engine, prompt, 0))
    start = loop.run(engine.client.server_info())["weight_version"]
    for step, seed in enumerate([1, 2], start=1):
        version = start + step
        loop.run(engine.sync_weights(published(lora_model(tiny_model_dir, seed)), version, "keep"))
        greedy, sampled = loop.run(greedy_and_sampled(engine, prompt, seed))
        merged = lora_model(tiny_model_dir, seed).merge_and_unload()
        assert greedy.token_ids == greedy_reference(merged, prompt)
        assert greedy.token_ids != base_greedy.token_ids  # the adapter matters
        assert greedy.weight_versions == sampled.weight_versions == [version] * TOKENS
        expected = logprobs_reference(merged, prompt, sampled.token_ids)
        err = max(abs(a - b) for a, b in zip(expected, sampled.logprobs, strict=True))
        assert err < 1e-4, (seed, err)

    # the second adapter replaced the first: base + d1 + d2 would sample differently
    wrong = logprobs_reference(stacked_model(tiny_model_dir, 1, 2), prompt, sampled.token_ids)
    assert max(abs(a - b) for a, b in zip(wrong, sampled.logprobs, strict=True)) > 1e-2


def _renamed(named, old: str, new: str):
    return [(name.replace(old, new), tensor) for name, tensor in named]


@pytest.mark.parametrize(
    "case, message",
    [
        ("lone_a", "has no lora_B"),
        ("wrong_shape", r"B @ A is \(\d+, \d+\) but"),
        ("no_such_module", "names no weight of the model"),
        ("mixed", "mixes adapter tensors"),
    ],
)
def test_malformed_adapters_are_refused_and_change_nothing(
    engine, loop, prompt, tiny_model_dir, case, message
):
    adapter = published(lora_model(tiny_model_dir, 3))
    bad = {
        "lone_a": [(n, t) for n, t in adapter if ".lora_B." not in n or "layers.1." not in n],
        "wrong_shape": [
            (n, t[:, :-1] if "1.self_attn.q_proj.lora_A" in n else t) for n, t in adapter
        ],
        "no_such_module": _renamed(adapter, "layers.1.", "layers.7."),
        "mixed": adapter + [("model.norm.weight", torch.ones(64))],
    }[case]

    async def scenario():
        before = await greedy_and_sampled(engine, prompt, 5)
        info = await engine.client.server_info()
        with pytest.raises(EngineRefused, match=message):  # paused, refused, resumed
            await engine.sync_weights(bad, info["weight_version"] + 1, "keep")
        after = await asyncio.wait_for(greedy_and_sampled(engine, prompt, 5), 60)
        return before, after, info, await engine.client.server_info()

    before, after, info, info_after = loop.run(scenario())
    assert after[0].token_ids == before[0].token_ids
    assert after[1].logprobs == before[1].logprobs
    assert info_after["weight_version"] == info["weight_version"]


def test_a_full_sync_replaces_the_base_the_next_adapter_merges_onto(
    engine, loop, prompt, tiny_model_dir
):
    """An adapter, full weights (every tensor, the tied head included), an adapter: the
    last lands on the new weights, and each sync samples as a transformers forward does."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    scaled = {k: v * 1.1 for k, v in model.state_dict().items()}
    model.load_state_dict(scaled)
    wrapped = lora_model(tiny_model_dir, 4)
    with torch.no_grad():  # peft keeps the adapted weights under .base_layer
        for name, param in wrapped.get_base_model().named_parameters():
            plain = name.replace(".base_layer", "")
            if "lora_" not in name:
                param.copy_(scaled[plain])
    adapter = published(wrapped)
    merged = wrapped.merge_and_unload()
    start = loop.run(engine.client.server_info())["weight_version"]
    earlier = published(lora_model(tiny_model_dir, 5))  # base copies exist before the full sync
    loop.run(engine.sync_weights(earlier, start + 1, "keep"))
    for version, weights, reference in [
        (start + 2, list(scaled.items()), model),
        (start + 3, adapter, merged),
    ]:
        loop.run(engine.sync_weights(weights, version, "keep"))
        greedy, sampled = loop.run(greedy_and_sampled(engine, prompt, version))
        assert greedy.token_ids == greedy_reference(reference, prompt)
        expected = logprobs_reference(reference, prompt, sampled.token_ids)
        err = max(abs(a - b) for a, b in zip(expected, sampled.logprobs, strict=True))
        assert err < 1e-4, (version, err)


def test_an_adapter_on_a_tied_head_unties_it_and_leaves_the_embedding_alone(
    engine, loop, prompt, tiny_model_dir
):
    """Tinker trains the unembedding by default, and the tiny model (like SmolLM2) ties it
    to the input embedding: the engine gives the head its own copy, so the adapter changes
    the output layer only. Reference: a transformers copy untied by hand, W_head + B @ A."""
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    hidden, vocab = reference.config.hidden_size, reference.config.vocab_size
    torch.manual_seed(6)
    a, b = torch.randn(RANK, hidden) * 0.3, torch.randn(vocab, RANK) * 0.3
    head = "base_model.model.lm_head"
    adapter = published(lora_model(tiny_model_dir, 6)) + [
        (f"{head}.lora_A.weight", a),
        (f"{head}.lora_B.weight", b),
    ]
    merged = lora_model(tiny_model_dir, 6).merge_and_unload()  # attention adapters only
    with torch.no_grad():
        merged.lm_head.weight = torch.nn.Parameter(merged.lm_head.weight + b @ a)
    assert merged.lm_head.weight.data_ptr() != merged.model.embed_tokens.weight.data_ptr()
    version = loop.run(engine.client.server_info())["weight_version"] + 1
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    loop.run(engine.sync_weights(list(base.state_dict().items()), version, "keep"))  # the base
    loop.run(engine.sync_weights(adapter, version + 1, "keep"))
    greedy, sampled = loop.run(greedy_and_sampled(engine, prompt, 6))
    assert greedy.token_ids == greedy_reference(merged, prompt)
    expected = logprobs_reference(merged, prompt, sampled.token_ids)
    err = max(abs(x - y) for x, y in zip(expected, sampled.logprobs, strict=True))
    assert err < 1e-4, err

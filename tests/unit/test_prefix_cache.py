"""The prompt-prefix cache: exact reuse of earlier prompts' keys and values, LRU bounds."""

import asyncio

import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.prefix_cache import BLOCK, PrefixCache
from asyncgrpo.inference.engine.runner import ModelRunner
from asyncgrpo.inference.engine.types import SamplingParams


def reference_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


async def collect(engine, prompt, **kw):
    ids, lps = [], []
    async for d in engine.generate(prompt, SamplingParams(**kw)):
        ids += d.token_ids
        lps += d.logprobs
    return ids, lps


def test_prompts_sharing_a_prefix_reuse_it_and_stay_exact(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = Engine(
        EmbeddedEngineConfig(
            model=str(tiny_model_dir), dtype="float32", max_num_seqs=8, prefill_chunk_size=32
        )
    )
    eng.start()
    try:
        system = eng.tokenizer.encode("You are a careful assistant. " * 6, add_special_tokens=False)
        assert len(system) >= 3 * BLOCK
        prompts = [
            system + eng.tokenizer.encode(f" Question {i}: what is {i} + {i}?") for i in range(6)
        ]
        # longer than the chunk size after the cached prefix: prefilled in chunks from a hit
        prompts.append(system + eng.tokenizer.encode(" Tell a long story. " * 8))

        async def scenario():
            first = await collect(eng, prompts[0], max_tokens=5, seed=0, ignore_eos=True)
            rest = await asyncio.gather(
                *(
                    collect(eng, p, max_tokens=5, seed=i, ignore_eos=True)
                    for i, p in enumerate(prompts[1:])
                )
            )
            return [first, *rest]

        results = asyncio.run(scenario())
        for prompt, (ids, lps) in zip(prompts, results, strict=True):
            ref = reference_logprobs(reference, prompt, ids)
            assert max(abs(a - b) for a, b in zip(ref, lps, strict=True)) < 1e-4
        shared = (len(system) // BLOCK) * BLOCK
        assert eng.stats()["cached_prompt_tokens"] >= shared * (len(prompts) - 1)
    finally:
        eng.shutdown()


def test_cache_is_bounded_lru_and_copies_exact_values(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model, num_slots=4, max_model_len=256)
    cache = PrefixCache(runner, capacity_tokens=3 * BLOCK)
    vocab = model.config.vocab_size
    a = [(3 + 5 * i) % vocab for i in range(4 * BLOCK + 3)]  # four full blocks and a bit
    runner.prefill([0], [a], [0])
    cache.store(a, slot=0, length=len(a))  # room for three blocks: the fourth is dropped
    hits, missing = cache.lookup(a, len(a) - 1)
    assert len(hits) == 3 and missing == (hits[-1], tuple(a[3 * BLOCK : 4 * BLOCK]))
    # the loaded keys and values are exactly those the prompt computed
    assert cache.load(hits, slot=2) == 3 * BLOCK
    for k in runner.k_cache:
        assert torch.equal(k[2, :, : 3 * BLOCK], k[0, :, : 3 * BLOCK])
    for v in runner.v_cache:
        assert torch.equal(v[2, :, : 3 * BLOCK], v[0, :, : 3 * BLOCK])
    # a new prompt evicts the least recently used block: a's first, which cuts a's chain
    b = [(7 + 3 * i) % vocab for i in range(BLOCK + 1)]
    runner.prefill([1], [b], [0])
    cache.store(b, slot=1, length=len(b))
    assert cache.lookup(a, len(a) - 1)[0] == []
    assert len(cache.lookup(b, len(b))[0]) == 1
    # a prompt differing inside a block shares only the blocks before it
    c = a[: BLOCK + 5] + [a[BLOCK + 5] + 1] + a[BLOCK + 6 :]
    cache.clear()
    cache.store(a, slot=0, length=2 * BLOCK)
    assert len(cache.lookup(c, len(c))[0]) == 1
    assert cache.lookup(a, 2 * BLOCK)[1] is None


def test_a_finished_turn_is_reused_by_the_next_turn(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = Engine(EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4))
    eng.start()
    try:
        prompt = eng.tokenizer.encode("User: plan a trip to the mountains. " * 3)
        probe, _ = asyncio.run(collect(eng, prompt, max_tokens=48, temperature=0, ignore_eos=True))
        # a token whose first occurrence is late in the greedy output ends the turn there
        j = next(i for i in range(40, 0, -1) if probe[i] not in probe[:i])
        assert j >= BLOCK, "the turn must fill at least one block beyond the prompt"
        turn, _ = asyncio.run(
            collect(eng, prompt, max_tokens=48, temperature=0, stop_token_ids=[probe[j]])
        )
        assert turn == probe[: j + 1]
        next_prompt = prompt + turn + eng.tokenizer.encode(" Tool: 3 trails found.")
        before = eng.stats()["cached_prompt_tokens"]
        ids, lps = asyncio.run(collect(eng, next_prompt, max_tokens=6, seed=3, ignore_eos=True))
        reused = eng.stats()["cached_prompt_tokens"] - before
        # everything the first turn computed (prompt and generated tokens, but the last)
        assert reused == ((len(prompt) + j) // BLOCK) * BLOCK
        ref = reference_logprobs(reference, next_prompt, ids)
        assert max(abs(a - b) for a, b in zip(ref, lps, strict=True)) < 1e-4
    finally:
        eng.shutdown()

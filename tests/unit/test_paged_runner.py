"""The engine on a paged KV cache (`engine.kv_cache: paged`): the same tokens and log-probs
as the slot cache, bit for bit (FlexAttention's: the same tokens), and blocks shared
instead of copied."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.paged.prefix import PagedPrefixCache
from asyncgrpo.inference.engine.paged.runner import PagedModelRunner
from asyncgrpo.inference.engine.prefix_cache import BLOCK
from asyncgrpo.inference.engine.runner import ModelRunner
from asyncgrpo.inference.engine.types import SamplingParams


async def _collect(engine, prompt, params):
    by_index: dict[int, dict] = {}
    async for d in engine.generate(prompt, params):
        out = by_index.setdefault(d.index, {"ids": [], "lps": [], "finish": None})
        out["ids"] += d.token_ids
        out["lps"] += d.logprobs
        out["finish"] = d.finish_reason or out["finish"]
        if d.prompt_logprobs is not None:
            out["prompt"] = list(d.prompt_logprobs.logprobs)
    return [by_index[i] for i in sorted(by_index)]


def _workload(tokenizer):
    """Prompts that take every path: a shared system prefix (prefix-cache hits), groups of
    n (slot copies), samples finishing at different steps (compaction), a prompt longer
    than the prefill chunk (staging), prompt log-probs, and a second turn that starts
    with a finished first one."""
    system = tokenizer.encode("You are a careful assistant. " * 5, add_special_tokens=False)
    asks = [system + tokenizer.encode(f" Question {i}: add {i} and {i}.") for i in range(5)]
    story = system + tokenizer.encode(" Tell a long story about a lighthouse. " * 6)
    jobs = [(p, SamplingParams(max_tokens=6 + 3 * i, seed=i, n=3)) for i, p in enumerate(asks)]
    jobs.append((story, SamplingParams(max_tokens=9, seed=7, temperature=0.7, top_p=0.9)))
    jobs.append((asks[0], SamplingParams(max_tokens=4, seed=3, prompt_logprobs=1)))
    return system, jobs


def _run(model_dir, kv_cache: str, attention: str = "auto"):
    config = EmbeddedEngineConfig(
        model=str(model_dir), dtype="float32", max_num_seqs=8, prefill_chunk_size=32,
        kv_cache=kv_cache, paged_attention=attention,
    )  # fmt: skip
    engine = Engine(config)
    assert isinstance(engine.runner, PagedModelRunner) == (kv_cache == "paged")
    if kv_cache == "paged":
        assert engine.runner.attention == ("gather" if attention == "auto" else attention)
    engine.start()
    try:
        system, jobs = _workload(engine.tokenizer)

        async def scenario():
            first = await _collect(engine, *jobs[0])  # its prompt is cached before the rest
            rest = await asyncio.gather(*(_collect(engine, *job) for job in jobs[1:]))
            turn = jobs[-2][0] + rest[-2][0]["ids"] + engine.tokenizer.encode(" Go on.")
            follow = await _collect(engine, turn, SamplingParams(max_tokens=5, seed=11))
            return [first, *rest, follow]

        results = asyncio.run(scenario())
        return results, engine.stats()
    finally:
        engine.shutdown()


def test_paged_engine_samples_exactly_what_the_slot_engine_samples(tiny_model_dir):
    slots, slot_stats = _run(tiny_model_dir, "slots")
    paged, paged_stats = _run(tiny_model_dir, "paged")
    assert paged == slots  # token ids, log-probs, finish reasons, prompt log-probs
    assert any("prompt" in sample for result in paged for sample in result)
    assert paged_stats["cached_prompt_tokens"] >= 4 * 3 * BLOCK  # four asks hit the system
    assert paged_stats["cached_prompt_tokens"] == slot_stats["cached_prompt_tokens"]


def test_the_engine_over_flex_attention_samples_the_slot_engines_tokens(tiny_model_dir):
    """The CUDA engine's attention (`paged_attention: flex`, eager on a CPU) over the same
    workload: the same tokens, log-probs equal up to float32 rounding (the keys are summed
    in another order than the gathered ones)."""
    slots, _ = _run(tiny_model_dir, "slots")
    flex, stats = _run(tiny_model_dir, "paged", "flex")
    assert stats["cached_prompt_tokens"] >= 4 * 3 * BLOCK  # shared prefixes read in place
    for got, want in zip(flex, slots, strict=True):
        assert [s["ids"] for s in got] == [s["ids"] for s in want]
        assert [s["finish"] for s in got] == [s["finish"] for s in want]
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine["lps"], theirs["lps"], rtol=0, atol=1e-4)
            if "prompt" in theirs:
                torch.testing.assert_close(mine["prompt"], theirs["prompt"], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return PagedModelRunner(model, num_slots=4, max_model_len=256, block_size=BLOCK)


def test_copies_share_full_blocks_and_copy_only_the_partial_one(runner):
    prompt = [(7 + 3 * i) % 97 + 3 for i in range(2 * BLOCK + 5)]  # two full blocks + 5
    runner.prefill([0], [prompt], [0])
    runner.copy_slot(0, 1, len(prompt))
    source, copy = runner.tables.sequences[0], runner.tables.sequences[1]
    assert copy.blocks[:2] == source.blocks[:2] and copy.blocks[2] != source.blocks[2]
    assert all(runner.allocator.refs[b] == 2 for b in source.blocks[:2])
    keys = runner.cache.keys
    for src, dst in zip(source.blocks, copy.blocks, strict=True):
        span = slice(src * BLOCK, (src + 1) * BLOCK)
        assert torch.equal(keys[:, :, span], keys[:, :, dst * BLOCK : (dst + 1) * BLOCK])
    # both continue alike: one decode step over the pair gives one row of logits twice
    logits = runner.decode(torch.tensor([5, 5]), torch.tensor([len(prompt)] * 2))
    assert torch.equal(logits[0], logits[1])
    runner.swap_slots(0, 1, len(prompt) + 1)
    assert runner.tables.sequences[0] is copy and runner.tables.sequences[1] is source
    runner.release_memory()
    assert not runner.tables.sequences
    assert runner.allocator.free_count == runner.allocator.num_blocks - 1


def test_a_cached_prefix_is_shared_in_place_and_forgotten_on_clear(runner):
    cache = PagedPrefixCache(runner, capacity_tokens=8 * BLOCK)
    prompt = [(11 + 5 * i) % 89 + 3 for i in range(3 * BLOCK + 2)]
    runner.prefill([0], [prompt], [0])
    cache.store(prompt, slot=0, length=len(prompt))
    hits, missing = cache.lookup(prompt, len(prompt) - 1)
    assert hits == runner.tables.sequences[0].blocks[:3] and missing is None
    free_before = runner.allocator.free_count
    assert cache.load(hits, slot=2) == 3 * BLOCK
    assert runner.allocator.free_count == free_before  # shared, nothing allocated
    # the rest of the prompt after the hit computes the same last logits as the full prefill
    alone = ModelRunner(runner.model, num_slots=1, max_model_len=256)
    want = alone.prefill([0], [prompt], [0])
    got = runner.prefill([2], [prompt[3 * BLOCK :]], [3 * BLOCK])
    assert torch.equal(got, want)
    cache.clear()
    assert cache.lookup(prompt, len(prompt) - 1)[0] == []
    runner.release_memory()


def _steps(runner, prompts):
    """Prefill two prompts (the second after a shared cached prefix), fork the first into
    two samples and decode four steps; every step's logits."""
    cache = PagedPrefixCache(runner, capacity_tokens=8 * BLOCK)
    out = [runner.prefill([0], [prompts[0]], [0])]
    cache.store(prompts[0], slot=0, length=len(prompts[0]))
    hits, _ = cache.lookup(prompts[1], len(prompts[1]) - 1)
    start = cache.load(hits, slot=2)
    out.append(runner.prefill([2], [prompts[1][start:]], [start]))
    runner.copy_slot(0, 1, len(prompts[0]))
    runner.copy_slot(2, 3, len(prompts[1]))  # rows 2 and 3: the two branches of prompt 1
    lengths = [len(prompts[0])] * 2 + [len(prompts[1])] * 2
    for step in range(4):
        tokens = torch.tensor([3 + step, 4 + step, 5 + step, 6 + step])
        out.append(runner.decode(tokens, torch.tensor(lengths) + step))
    runner.release_memory()
    return out


def test_flex_attention_over_the_pools_matches_the_gathered_keys(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    shared = [(13 + 7 * i) % 83 + 3 for i in range(2 * BLOCK)]
    prompts = [shared + [5, 9, 11], shared + list(range(20, 20 + BLOCK + 3))]
    results = {}
    for attention in ("gather", "flex"):
        runner = PagedModelRunner(model, 4, 128, BLOCK, prefix_blocks=8, attention=attention)
        results[attention] = _steps(runner, prompts)
    assert len(results["flex"]) == 6
    for flex, gather in zip(results["flex"], results["gather"], strict=True):
        torch.testing.assert_close(flex, gather, rtol=0, atol=1e-10)


def test_a_decode_padded_to_its_graph_bucket_computes_the_unpadded_logits(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    prompts = [[(5 + 3 * i + j) % 90 + 3 for i in range(BLOCK + 4 + 7 * j)] for j in range(3)]
    lengths = torch.tensor([len(p) for p in prompts])
    logits = {}
    for bucketed in (False, True):
        runner = PagedModelRunner(model, 4, 128, BLOCK, attention="flex")
        runner.prefill([0, 1, 2], prompts, [0, 0, 0])
        steps = []
        for step in range(3):  # the dummies' writes to the scratch block touch no real row
            tokens = torch.tensor([7 + step, 8 + step, 9 + step])
            if bucketed:
                steps.append(runner.decode_in_bucket(tokens, lengths + step, bucket=8))
            else:
                steps.append(runner.decode(tokens, lengths + step))
        logits[bucketed] = steps
    for padded, plain in zip(logits[True], logits[False], strict=True):
        assert padded.shape == plain.shape == (3, model.config.vocab_size)
        torch.testing.assert_close(padded, plain, rtol=0, atol=1e-12)

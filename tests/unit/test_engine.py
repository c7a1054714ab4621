"""Embedded engine behaviour on a tiny random Llama (no HTTP): log-probs, batching, pauses."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.engine.engine import Engine, EngineConfig
from asyncgrpo.engine.types import EngineError, PauseMode, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=8))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


async def collect(engine, prompt, **kw):
    out = {}
    async for d in engine.generate(prompt, SamplingParams(**kw)):
        o = out.setdefault(d.index, {"ids": [], "lp": [], "v": [], "finish": None})
        o["ids"] += d.token_ids
        o["lp"] += d.logprobs
        o["v"] += d.versions
        if d.finish_reason:
            o["finish"] = d.finish_reason
    return [out[i] for i in sorted(out)]


def reference_logprobs(model, prompt, completion, temperature=1.0):
    """log-softmax of a plain forward pass over prompt + completion, at the sampled tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def run(coro):
    return asyncio.run(coro)


def prompt_ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_logprobs_match_plain_forward_and_lengths_agree(engine, reference):
    prompt = prompt_ids(engine, "Hello, world! How are you")
    for temperature in (1.0, 0.7):
        samples = run(
            collect(
                engine, prompt, max_tokens=24, temperature=temperature, n=3, seed=5, ignore_eos=True
            )
        )
        for s in samples:
            assert len(s["ids"]) == len(s["lp"]) == len(s["v"]) == 24
            ref = reference_logprobs(reference, prompt, s["ids"], temperature)
            assert max(abs(a - b) for a, b in zip(ref, s["lp"])) < 1e-4


def test_greedy_is_deterministic_and_seeds_reproduce(engine):
    prompt = prompt_ids(engine, "What is 12 + 7?")
    a = run(collect(engine, prompt, max_tokens=16, temperature=0))
    b = run(collect(engine, prompt, max_tokens=16, temperature=0))
    assert a[0]["ids"] == b[0]["ids"]
    s1 = run(collect(engine, prompt, max_tokens=16, temperature=1.0, seed=11, n=2, ignore_eos=True))
    s2 = run(collect(engine, prompt, max_tokens=16, temperature=1.0, seed=11, n=2, ignore_eos=True))
    assert [s["ids"] for s in s1] == [s["ids"] for s in s2]
    assert s1[0]["ids"] != s1[1]["ids"]  # each of the n samples gets its own stream


def test_concurrent_requests_of_mixed_lengths_stay_exact(engine, reference):
    """Requests join and leave the batch at different steps (slot compaction, n>1)."""

    async def many():
        jobs = [
            collect(
                engine,
                prompt_ids(engine, f"What is {i} + {3 * i}? " * (1 + i % 3)),
                max_tokens=3 + 5 * i,
                temperature=1.0,
                n=1 + i % 3,
                seed=i,
                ignore_eos=True,
            )
            for i in range(10)
        ]
        return await asyncio.gather(*jobs)

    results = run(many())
    for i, samples in enumerate(results):
        prompt = prompt_ids(engine, f"What is {i} + {3 * i}? " * (1 + i % 3))
        assert len(samples) == 1 + i % 3
        for s in samples:
            assert len(s["ids"]) == 3 + 5 * i and s["finish"] == "length"
            ref = reference_logprobs(reference, prompt, s["ids"])
            assert max(abs(a - b) for a, b in zip(ref, s["lp"])) < 1e-4


def test_long_prompt_is_prefilled_in_chunks(tiny_model_dir, reference):
    eng = Engine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", max_num_seqs=4, prefill_chunk_size=64
        )
    )
    eng.start()
    try:
        prompt = prompt_ids(eng, "The quick brown fox jumps over the lazy dog. " * 30)[:300]
        samples = run(collect(eng, prompt, max_tokens=8, temperature=1.0, seed=1, ignore_eos=True))
        ref = reference_logprobs(reference, prompt, samples[0]["ids"])
        assert max(abs(a - b) for a, b in zip(ref, samples[0]["lp"])) < 1e-4
    finally:
        eng.shutdown()


def test_stop_token_and_stop_string(engine):
    prompt = prompt_ids(engine, "Hello")
    free = run(collect(engine, prompt, max_tokens=20, temperature=0, ignore_eos=True))[0]["ids"]
    stop_id = free[3]
    first = free.index(stop_id)
    out = run(
        collect(
            engine, prompt, max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]
        )
    )[0]
    assert out["ids"] == free[: first + 1] and out["finish"] == "stop"
    text = engine.tokenizer.decode(free[:6])
    stop = text[-3:]
    out = run(collect(engine, prompt, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert out["finish"] == "stop"
    assert stop in engine.tokenizer.decode(out["ids"]) and len(out["ids"]) <= 6


def test_rejects_bad_requests_and_keeps_serving(engine):
    with pytest.raises(EngineError, match="max_model_len"):
        run(collect(engine, [5] * (engine.max_model_len + 1), max_tokens=1))
    with pytest.raises(EngineError):
        run(collect(engine, [engine.vocab_size + 10], max_tokens=1))
    with pytest.raises(EngineError):
        run(collect(engine, [1, 2], max_tokens=0))
    assert run(collect(engine, [1, 2, 3], max_tokens=2, temperature=0))[0]["finish"] == "length"


def test_max_tokens_clipped_to_context(engine):
    prompt = [7] * (engine.max_model_len - 3)
    out = run(collect(engine, prompt, max_tokens=50, temperature=1.0, ignore_eos=True))[0]
    assert len(out["ids"]) == 3 and out["finish"] == "length"


def test_pause_modes_and_weight_update(tiny_model_dir, reference):
    eng = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4))
    eng.start()
    # long enough for cached prefix blocks, which must not outlive the old weights
    prompt = prompt_ids(eng, "Hello, world! " * 12)
    new_state = {k: v * 1.05 for k, v in reference.state_dict().items()}
    updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    updated.load_state_dict(new_state)

    async def scenario():
        before = (await collect(eng, prompt, max_tokens=8, temperature=0, ignore_eos=True))[0]
        # keep: the in-flight request survives the swap; its tokens carry both versions.
        task = asyncio.create_task(
            collect(eng, prompt, max_tokens=150, temperature=1.0, ignore_eos=True)
        )
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        await eng.pause(PauseMode.KEEP)
        assert eng.is_paused
        await eng.update_weights(new_state.items())
        eng.set_weight_version(1)
        await eng.resume()
        kept = (await task)[0]
        assert kept["finish"] == "length" and len(kept["ids"]) == 150
        assert kept["v"][0] == 0 and kept["v"][-1] == 1 and kept["v"] == sorted(kept["v"])
        after = (await collect(eng, prompt, max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert after["v"] == [1] * 8 and after["lp"] != before["lp"]
        # the engine computes with the new weights exactly (its packed copies were rebuilt)
        ref = reference_logprobs(updated, prompt, after["ids"])
        assert max(abs(a - b) for a, b in zip(ref, after["lp"])) < 1e-4
        # abort: partial output, finish_reason "abort".
        task = asyncio.create_task(
            collect(eng, prompt, max_tokens=400, temperature=1.0, ignore_eos=True)
        )
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        await eng.pause(PauseMode.ABORT)
        aborted = (await task)[0]
        assert aborted["finish"] == "abort" and 0 < len(aborted["ids"]) < 400
        await eng.resume()
        # wait: pause returns only once the running request has finished.
        task = asyncio.create_task(
            collect(eng, prompt, max_tokens=60, temperature=1.0, ignore_eos=True)
        )
        while eng.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        await eng.pause(PauseMode.WAIT)
        assert task.done() and (await task)[0]["finish"] == "length"
        await eng.resume()
        # a bad update names the parameter and changes nothing
        with pytest.raises(EngineError, match="unknown parameter"):
            await eng.update_weights([("nope.weight", torch.zeros(1))])
        again = (await collect(eng, prompt, max_tokens=8, temperature=0, ignore_eos=True))[0]
        assert again["ids"] == after["ids"]

    try:
        run(scenario())
    finally:
        eng.shutdown()


def test_abandoned_stream_frees_its_slot(engine):
    async def scenario():
        gen = engine.generate(
            [1, 2, 3], SamplingParams(max_tokens=300, temperature=1.0, ignore_eos=True)
        )
        await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if engine.stats()["running"] == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(scenario())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_zeros_are_zeros_of_the_asked_shape_and_writable(dtype):
    from asyncgrpo.engine.runner import lazy_zeros

    t = lazy_zeros((3, 2, 5, 4), dtype)
    assert t.shape == (3, 2, 5, 4) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(3, 2, 5, 4, dtype=dtype))
    t[1, :, 2] = 7
    assert t.sum().item() == 7 * 2 * 4

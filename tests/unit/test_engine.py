"""Embedded engine behaviour on a tiny random Llama (no HTTP): log-probs, batching, pauses."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.types import PauseMode, RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = Engine(EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=8))
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
        EmbeddedEngineConfig(
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
    with pytest.raises(RequestError, match="max_model_len"):
        run(collect(engine, [5] * (engine.max_model_len + 1), max_tokens=1))
    with pytest.raises(RequestError):
        run(collect(engine, [engine.vocab_size + 10], max_tokens=1))
    with pytest.raises(RequestError):
        run(collect(engine, [1, 2], max_tokens=0))
    assert run(collect(engine, [1, 2, 3], max_tokens=2, temperature=0))[0]["finish"] == "length"


def test_max_tokens_clipped_to_context(engine):
    prompt = [7] * (engine.max_model_len - 3)
    out = run(collect(engine, prompt, max_tokens=50, temperature=1.0, ignore_eos=True))[0]
    assert len(out["ids"]) == 3 and out["finish"] == "length"


def test_pause_modes_and_weight_update(tiny_model_dir, reference):
    eng = Engine(EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4))
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
        with pytest.raises(RequestError, match="unknown parameter"):
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
    from asyncgrpo.inference.engine.runner import lazy_zeros

    t = lazy_zeros((3, 2, 5, 4), dtype)
    assert t.shape == (3, 2, 5, 4) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(3, 2, 5, 4, dtype=dtype))
    t[1, :, 2] = 7
    assert t.sum().item() == 7 * 2 * 4


@pytest.fixture
def unchecked(engine, monkeypatch):
    """The engine with its request checks off: where a value that slips past them lands."""
    monkeypatch.setattr(engine, "check_request", lambda prompt_ids, params: None)
    return engine


def test_poisoned_row_never_fails_the_rest_of_its_batch(unchecked):
    """top_k = 2**63 used to overflow in sampling on the engine thread and fail every
    request in the batch; now it is clamped where it enters the engine."""
    engine = unchecked
    prompt = prompt_ids(engine, "Hello, world! How are you")

    async def scenario():
        normal = asyncio.create_task(
            collect(engine, prompt, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
        )
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        poisoned = await collect(
            engine, prompt, max_tokens=8, temperature=1.0, top_k=2**63, ignore_eos=True
        )
        return await normal, poisoned

    normal, poisoned = run(scenario())
    assert normal[0]["finish"] == "length" and len(normal[0]["ids"]) == 40
    assert poisoned[0]["finish"] == "length" and len(poisoned[0]["ids"]) == 8


def test_a_request_whose_sampling_raises_fails_alone(engine, monkeypatch):
    """Whatever makes one request's rows raise mid-decode, in a batch shared with another
    request, only that request gets the error; the other's output is unchanged."""
    from asyncgrpo.inference.engine import scheduler

    real_sample = scheduler.sample
    seen = {"poisoned": 0, "mixed_batch_failures": 0}

    def sample_failing_after_first_token(logits, rows):
        poisoned = [r.top_p == 0.123 for r in rows]
        if any(poisoned):
            seen["poisoned"] += 1
            if seen["poisoned"] > 1:  # its first token (at prefill) is fine, then it raises
                seen["mixed_batch_failures"] += not all(poisoned)
                raise RuntimeError("poisoned row")
        return real_sample(logits, rows)

    monkeypatch.setattr(scheduler, "sample", sample_failing_after_first_token)
    prompt = prompt_ids(engine, "What is 12 + 7?")
    greedy = dict(max_tokens=200, temperature=0, ignore_eos=True)

    async def scenario():
        normal = asyncio.create_task(collect(engine, prompt, **greedy))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.005)
        poisoned = collect(engine, prompt, max_tokens=8, top_p=0.123, n=2)
        return await asyncio.gather(normal, poisoned, return_exceptions=True)

    reference = run(collect(engine, prompt, **greedy))
    normal, poisoned = run(scenario())
    assert isinstance(poisoned, RequestError) and "poisoned row" in poisoned.message
    assert poisoned.status == 400 and "top_p=0.123" in poisoned.message
    assert seen["mixed_batch_failures"] >= 1  # it failed while batched with the normal one
    assert normal == reference
    assert engine.stats()["running"] == 0 and not engine.scheduler.live


def test_seed_near_two_to_the_64_wraps_instead_of_overflowing(unchecked):
    engine = unchecked
    prompt = prompt_ids(engine, "Hello")
    kw = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    wrapped = run(collect(engine, prompt, seed=2**64 - 1, n=2, **kw))
    zero = run(collect(engine, prompt, seed=0, **kw))
    assert wrapped[1]["ids"] == zero[0]["ids"]  # sample 1 seeds (2**64 - 1 + 1) % 2**64 = 0


def test_tiny_temperature_samples_greedily(engine):
    prompt = prompt_ids(engine, "What is 12 + 7?")
    greedy = run(collect(engine, prompt, max_tokens=12, temperature=0, ignore_eos=True))[0]
    tiny = run(collect(engine, prompt, max_tokens=12, temperature=1e-40, ignore_eos=True))[0]
    assert tiny["ids"] == greedy["ids"] and tiny["lp"] == pytest.approx(greedy["lp"], abs=1e-5)


def test_top_logprobs_with_top_p_are_valid_json(engine):
    """Masked alternatives are -inf in the engine; the OpenAI layer reports -9999.0 (vLLM)."""
    import json

    from asyncgrpo.inference.server import openai_format as fmt

    prompt = prompt_ids(engine, "Hello, world!")

    async def deltas():
        params = SamplingParams(
            max_tokens=6, temperature=0.1, top_p=0.5, top_logprobs=5, seed=1, ignore_eos=True
        )
        return [d async for d in engine.generate(prompt, params)]

    got = run(deltas())
    ids = [t for d in got for t in d.token_ids]
    lps = [lp for d in got for lp in d.logprobs]
    tops = [top for d in got for top in d.top_logprobs]
    assert any(lp == float("-inf") for top in tops for _, lp in top)
    token_text = fmt.TokenText(engine.tokenizer)
    chat = fmt.chat_logprobs(token_text, ids, lps, tops)
    completion = fmt.completion_logprobs(token_text, ids, lps, tops)
    json.dumps([chat, completion], allow_nan=False)
    alternatives = [a["logprob"] for c in chat["content"] for a in c["top_logprobs"]]
    assert -9999.0 in alternatives and min(alternatives) == -9999.0
    assert fmt.json_logprob(float("nan")) == fmt.json_logprob(float("-inf")) == -9999.0


def test_many_stop_strings_still_stop_at_the_right_place(unchecked):
    """The server allows a few stop strings; the engine stays correct (and cheap) with many."""
    engine = unchecked
    prompt = prompt_ids(engine, "Hello")
    free = run(collect(engine, prompt, max_tokens=20, temperature=0, ignore_eos=True))[0]["ids"]
    stop = engine.tokenizer.decode(free[:6])[-3:]
    single = run(
        collect(engine, prompt, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )
    noise = [f"never-{i}-{'x' * (i % 40)}" for i in range(10_000)]
    stops = noise[:5000] + ["", stop, stop] + noise[5000:]
    many = run(collect(engine, prompt, max_tokens=20, temperature=0, ignore_eos=True, stop=stops))
    assert many[0]["finish"] == single[0]["finish"] == "stop"
    assert many[0]["ids"] == single[0]["ids"]


def test_stop_token_ids_outside_the_vocabulary_are_harmless(unchecked):
    engine = unchecked
    prompt = prompt_ids(engine, "Hello")
    out = run(
        collect(
            engine,
            prompt,
            max_tokens=5,
            temperature=0,
            ignore_eos=True,
            stop_token_ids=[-1, 2**70, engine.vocab_size],
        )
    )[0]
    assert out["finish"] == "length" and len(out["ids"]) == 5


def test_a_failing_prefill_forward_fails_its_requests_instead_of_hanging(engine, monkeypatch):
    """A request admitted straight into a prefill is in no queue until its samples start;
    when that forward raises, its consumer still gets the error, and the engine serves on."""
    calls = {"n": 0}
    real_prefill = engine.runner.prefill

    def prefill_failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("forward blew up")
        return real_prefill(*args)

    monkeypatch.setattr(engine.runner, "prefill", prefill_failing_once)
    prompt = prompt_ids(engine, "What is 12 + 7?")
    with pytest.raises(RuntimeError, match="forward blew up"):
        run(asyncio.wait_for(collect(engine, prompt, max_tokens=2), 30))
    assert not engine.scheduler.live
    assert len(run(collect(engine, prompt, max_tokens=2, ignore_eos=True))[0]["ids"]) == 2
    assert calls["n"] == 2


def test_only_the_engine_thread_computes_on_several_threads(tiny_model_dir):
    """libgomp throttles every pool once two threads own one (engine.py): the thread that
    builds the engine stays on one thread, the engine thread takes `num_threads`."""
    before = torch.get_num_threads()
    eng = Engine(EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=2))
    try:
        assert torch.get_num_threads() == 1
        eng.start()
        assert run(eng._run_on_engine(torch.get_num_threads)) == 2
        assert torch.get_num_threads() == 1  # the engine's setting is its own thread's
    finally:
        eng.shutdown()
        torch.set_num_threads(before)

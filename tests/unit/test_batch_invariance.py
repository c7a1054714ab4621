"""A request's tokens and log-probs do not depend on which requests share its batch.

Continuous batching puts a request next to whatever else arrived, and arrival is
timing: a synchronous run with a fixed seed repeats exactly only if those neighbours
change no bit of its numbers. These tests force the compositions by driving the
scheduler step by step (no engine thread, no timing) and compare bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.request import Request
from asyncgrpo.inference.engine.types import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # never started: the test drives its scheduler on this thread
    config = EmbeddedEngineConfig(
        model=str(tiny_model_dir), dtype="float32", num_threads=1, max_num_seqs=8
    )
    return Engine(config)


def tokens(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run_schedule(engine, arrivals: dict[int, list[list[int]]]) -> list[dict]:
    """Add each prompt at its step, step the scheduler until idle; each request's samples
    as {index: (token ids, log-probs)}, in the order they were added."""

    async def drive():
        engine.prefix_cache.clear()
        requests = []
        step = 0
        while step <= max(arrivals) or engine.scheduler.has_work(admit=True):
            for prompt in arrivals.get(step, []):
                params = SamplingParams(max_tokens=12, seed=11, n=2, ignore_eos=True)
                rid = f"req-{len(requests)}"
                request = Request.create(
                    rid, prompt, params, engine.max_model_len, engine.vocab_size
                )
                engine.scheduler.live[rid] = request
                engine.scheduler.add(request)
                requests.append(request)
            with torch.inference_mode():
                engine.scheduler.step(admit=True)
            step += 1
        for _ in range(3):
            await asyncio.sleep(0)  # the deltas arrive by call_soon_threadsafe
        results = []
        for request in requests:
            samples: dict[int, tuple[list, list]] = {}
            while not request.queue.empty():
                for delta in request.queue.get_nowait():
                    ids, logprobs = samples.setdefault(delta.index, ([], []))
                    ids.extend(delta.token_ids)
                    logprobs.extend(delta.logprobs)
            results.append(samples)
        return results

    return asyncio.run(drive())


def test_neighbours_arrival_and_prefix_cache_hits_change_no_bit(engine):
    text = "the cat sat on the mat and the dog ran in the park with a red ball "
    prompt = tokens(engine, text * 2)[:40]
    # shares the prompt's first 32 tokens (two cache blocks), then differs
    sibling = prompt[:33] + tokens(engine, "so what")
    # long enough that its decode keys span another key block than the prompt's
    longer = tokens(engine, "a b c d e f g h i j " * 12)[:90]
    assert len(sibling) > 33 and len(longer) == 90

    (alone,) = run_schedule(engine, {0: [prompt]})
    assert len(alone) == 2 and all(len(ids) == 12 for ids, _ in alone.values())
    same_prefill = run_schedule(engine, {0: [longer, prompt]})[1]
    joins_mid_decode = run_schedule(engine, {0: [longer], 4: [prompt]})[1]
    cached_before = engine.cached_prompt_tokens
    after_cache_hit = run_schedule(engine, {0: [sibling], 2: [prompt]})[1]
    assert engine.cached_prompt_tokens - cached_before == 32, "the prompt missed the cache"

    assert same_prefill == alone
    assert joins_mid_decode == alone
    assert after_cache_hit == alone


def test_rows_are_regrouped_by_key_length_and_change_no_bit(engine, monkeypatch):
    """Decode keeps the rows of one key length in consecutive slots, longest first
    (scheduler.py): a long request joining short ones, and a row whose keys grow into the
    next block mid-decode, are swapped into place, caches and all."""
    from asyncgrpo.inference.engine.attention import decode_key_length

    text = "the cat sat on the mat and the dog ran in the park with a red ball "
    short = tokens(engine, text * 2)[:40]
    crossing = tokens(engine, text * 4)[:58]  # its 7th decode step reads 65 keys
    longer = tokens(engine, "a b c d e f g h i j " * 12)[:90]
    alone = [run_schedule(engine, {0: [prompt]})[0] for prompt in (short, crossing, longer)]

    decode, key_lengths = engine.runner.decode, []

    def recording(tokens_, positions):
        lengths = [decode_key_length(p + 1, engine.max_model_len) for p in positions.tolist()]
        key_lengths.append(lengths)
        return decode(tokens_, positions)

    monkeypatch.setattr(engine.runner, "decode", recording)
    mixed = run_schedule(engine, {0: [short, crossing], 3: [longer]})
    assert mixed == alone
    assert all(lengths == sorted(lengths, reverse=True) for lengths in key_lengths)
    assert {64, 128} <= {n for lengths in key_lengths for n in lengths}  # two blocks met
    crossed = [lengths.count(128) for lengths in key_lengths[:8]]
    assert crossed[0] == 0 and 0 < crossed[-1] < 6, crossed  # rows moved up mid-decode


def test_runner_rows_are_independent_of_padding_and_batch(engine):
    """The forward alone: prefill logits of a prompt alone, padded beside a longer one,
    and in two chunks; decode logits alone and beside a row in another key block."""
    runner = engine.runner
    short, long_ = list(range(3, 23)), list(range(5, 105))
    alone = runner.prefill([0], [short], [0])[0]
    padded = runner.prefill([1, 0], [long_, short], [0, 0])[1]
    runner.prefill([0], [short[:16]], [0])
    chunked = runner.prefill([0], [short[16:]], [16])[0]
    assert torch.equal(padded, alone) and torch.equal(chunked, alone)

    token, position = torch.tensor([7]), torch.tensor([len(short)])
    decoded_alone = runner.decode(token, position)[0]
    runner.prefill([0, 1], [short, long_], [0, 0])
    both = runner.decode(torch.tensor([7, 9]), torch.tensor([len(short), len(long_)]))
    assert torch.equal(both[0], decoded_alone)


def test_a_linear_row_is_the_same_alone_as_in_a_batch():
    """oneDNN and BLAS switch to a matrix-vector kernel for one or two rows, which rounds
    otherwise (seen at SmolLM2-135M's down projection, 1536 -> 576)."""
    from asyncgrpo.inference.engine.runner import _Linear, onednn_linear_available

    torch.manual_seed(0)
    weight = torch.randn(576, 1536) / 1536**0.5
    x = torch.randn(8, 1536)
    for use_onednn in sorted({False, onednn_linear_available(torch.float32)}):
        linear = _Linear(weight, None, use_onednn)
        batch = linear(x)
        for rows in (1, 2, 3):
            assert torch.equal(linear(x[:rows]), batch[:rows]), (use_onednn, rows)
        assert torch.equal(linear(x[None, None, 0])[0, 0], batch[0])  # any leading shape

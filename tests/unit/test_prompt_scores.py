"""`PromptScores` (engine/prompt_logprobs.py) against a plain-loop reference: log-probs,
ranks and top-k of every prompt token, whatever the chunking of the prefill and of the
LM-head passes (scores are float32, as the engine's logits are)."""

import math

import pytest
import torch

from asyncgrpo.inference.engine import prompt_logprobs
from asyncgrpo.inference.engine.prompt_logprobs import PromptScores

VOCAB, HIDDEN = 11, 6


def plain_scores(logits_rows: list[list[float]], prompt: list[int], k: int):
    """Per position p < L - 1: log-prob of prompt[p + 1], its rank (tokens at least as
    likely, itself included) and the k most likely (id, logprob), by Python loops."""
    logprobs, ranks, tops = [], [], []
    for p in range(len(prompt) - 1):
        row = logits_rows[p]
        norm = math.log(sum(math.exp(x) for x in row))
        logp = [x - norm for x in row]
        target = prompt[p + 1]
        logprobs.append(logp[target])
        ranks.append(sum(1 for x in logp if x >= logp[target]))
        order = sorted(range(len(logp)), key=lambda j: -logp[j])[:k]
        tops.append([(j, logp[j]) for j in order])
    return logprobs, ranks, tops


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("chunk", [4, 5, 17])
def test_scores_equal_a_plain_loop_whatever_the_chunking(monkeypatch, k, chunk):
    monkeypatch.setattr(prompt_logprobs, "SCORE_ROWS", 3)  # several LM-head passes per chunk
    gen = torch.Generator().manual_seed(chunk + k)
    prompt = torch.randint(0, VOCAB, (17,), generator=gen).tolist()
    hidden = torch.randn(len(prompt), HIDDEN, generator=gen, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    scores = PromptScores(prompt, k)
    for start in range(0, len(prompt), chunk):
        scores.add_chunk(lambda h: h @ head.T, hidden[start : start + chunk], start)
    result = scores.result()
    want_lp, want_rank, want_top = plain_scores((hidden @ head.T).tolist(), prompt, k)
    assert len(result.logprobs) == len(prompt) - 1
    assert result.logprobs == pytest.approx(want_lp, abs=1e-5)
    assert result.ranks == want_rank  # random float64 logits: no near ties
    assert [[t for t, _ in top] for top in result.top] == [[t for t, _ in top] for top in want_top]
    for got, want in zip(result.top, want_top, strict=True):
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)


def test_a_chunk_out_of_order_is_refused():
    scores = PromptScores([1, 2, 3, 4], 1)
    with pytest.raises(RuntimeError, match="prompt chunk at 2 after 0 scored"):
        scores.add_chunk(lambda h: h, torch.zeros(2, 5), 2)


def test_a_one_token_prompt_has_nothing_to_score():
    scores = PromptScores([7], 2)
    scores.add_chunk(lambda h: h, torch.zeros(1, 5), 0)
    assert scores.result().logprobs == [] and scores.result().top == []

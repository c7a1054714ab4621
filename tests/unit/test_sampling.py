"""Sampling draws from, and reports log-probs of, the processed distribution."""

import math

import pytest
import torch

from asyncgrpo.inference.engine.sampling import RowParams, sample


def processed_distribution(logits, temperature, top_k, top_p):
    """Slow reference: temperature, then top-k, then nucleus, renormalised (plain Python)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order
    z = sum(math.exp(scaled[i]) for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += math.exp(scaled[i]) / z
    z = sum(math.exp(scaled[i]) for i in kept)
    return {i: math.exp(scaled[i]) / z for i in kept}


def test_logprobs_and_frequencies_match_reference():
    logits = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2]
    for temperature, top_k, top_p in [
        (1.0, 0, 1.0),
        (0.5, 0, 1.0),
        (1.0, 3, 1.0),
        (1.3, 0, 0.8),
        (0.8, 5, 0.7),
    ]:
        ref = processed_distribution(logits, temperature, top_k, top_p)
        n = 4000
        gen = torch.Generator().manual_seed(0)
        rows = [RowParams(temperature, top_p, top_k, gen, 0)] * n
        out = sample(torch.tensor([logits] * n), rows)
        counts = {}
        for tok, lp in zip(out.tokens, out.logprobs):
            assert tok in ref, "a filtered-out token was drawn"
            assert abs(lp - math.log(ref[tok])) < 1e-5
            counts[tok] = counts.get(tok, 0) + 1
        for tok, p in ref.items():
            # within 5 standard deviations of the binomial count
            assert abs(counts.get(tok, 0) - n * p) < 5 * math.sqrt(n * p * (1 - p)) + 1


def test_greedy_rows_report_plain_logsoftmax_and_mix_with_sampled_rows():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    rows = [RowParams(0.0, 1.0, 0, None, 2), RowParams(1.0, 1.0, 0, None, 0)]
    out = sample(logits, rows)
    assert out.tokens[0] == 1
    assert abs(out.logprobs[0] - torch.log_softmax(logits[0], -1)[1].item()) < 1e-6
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2] and out.top_logprobs[1] is None


def test_seeded_rows_reproduce():
    logits = torch.randn(3, 50)
    a = sample(logits, [RowParams(1.0, 1.0, 0, torch.Generator().manual_seed(7), 0)] * 3)
    b = sample(logits, [RowParams(1.0, 1.0, 0, torch.Generator().manual_seed(7), 0)] * 3)
    assert a.tokens == b.tokens


def test_large_vocab_across_cdf_blocks_matches_reference():
    """Mass at block edges (1024-entry blocks), a partial last block, and top-k filtering."""
    vocab = 2500
    logits = [-4.0] * vocab
    favourites = {1023: 2.0, 1024: 1.5, 2047: 1.0, 2048: 0.5, 2499: 1.2, 0: 0.8}
    for i, v in favourites.items():
        logits[i] = v
    for top_k in (0, 4):
        ref = processed_distribution(logits, 1.0, top_k, 1.0)
        n = 3000
        gen = torch.Generator().manual_seed(1)
        out = sample(torch.tensor([logits] * n), [RowParams(1.0, 1.0, top_k, gen, 0)] * n)
        counts = {}
        for tok, lp in zip(out.tokens, out.logprobs):
            assert tok in ref, "a filtered-out token was drawn"
            assert abs(lp - math.log(ref[tok])) < 1e-5
            counts[tok] = counts.get(tok, 0) + 1
        for tok in favourites:
            p = ref.get(tok, 0.0)
            assert abs(counts.get(tok, 0) - n * p) < 5 * math.sqrt(n * p * (1 - p)) + 1


def test_logits_are_not_modified():
    logits = torch.randn(4, 3000)
    before = logits.clone()
    sample(logits, [RowParams(0.7, 0.9, 50, None, 3)] * 2 + [RowParams(0.0, 1.0, 0, None, 0)] * 2)
    assert torch.equal(logits, before)


def test_tiny_temperature_is_greedy_with_finite_logprobs():
    """logits / 1e-40 overflows float32 (inf - inf = NaN): such rows must sample greedily."""
    logits = torch.randn(4, 600) * 5
    for temperature in (1e-40, 1e-30, 1e-6):
        out = sample(logits, [RowParams(temperature, 1.0, 0, None, 3)] * 4)
        plain = torch.log_softmax(logits, dim=-1)
        assert out.tokens == logits.argmax(dim=-1).tolist()
        for i, (token, lp) in enumerate(zip(out.tokens, out.logprobs)):
            assert abs(lp - plain[i, token].item()) < 1e-5  # greedy: plain log-softmax
            assert all(math.isfinite(alp) for _, alp in out.top_logprobs[i])


def test_masked_alternatives_are_minus_inf_never_nan():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -2.0]])
    out = sample(logits, [RowParams(1.0, 0.5, 0, None, 4)])
    values = [lp for _, lp in out.top_logprobs[0]]
    assert not any(math.isnan(v) for v in values)
    assert values[0] > -1 and values[-1] == float("-inf")  # top_p keeps only the first two


def test_row_params_are_sanitised_so_sampling_cannot_overflow():
    """Out-of-range settings that reach the engine are clamped where they enter it."""
    row = RowParams.sanitised(1.0, 1.0, 2**63, None, 2**40, vocab=50)
    assert row.top_k == 0 and row.top_logprobs == 20
    assert RowParams.sanitised(1.0, 1.0, 7, None, 10, vocab=5).top_logprobs == 5
    assert RowParams.sanitised(1.0, 1.0, 7, None, 0, vocab=5).top_k == 0
    assert RowParams.sanitised(0.7, 0.9, 3, None, 2, vocab=5) == RowParams(0.7, 0.9, 3, None, 2)
    assert RowParams.sanitised(1.0, 1.0, -(2**70), None, 0, vocab=50).top_k == 0
    assert RowParams.sanitised(1.0, float("nan"), 0, None, 0, vocab=50).top_p == 1.0
    assert RowParams.sanitised(1.0, 7.0, 0, None, 0, vocab=50).top_p == 1.0
    assert RowParams.sanitised(float("nan"), 1.0, 0, None, 0, vocab=50).temperature == 0.0
    logits = torch.randn(2, 5)
    out = sample(logits, [RowParams.sanitised(1.0, 1.0, 2**63, None, 2**40, vocab=5)] * 2)
    assert len(out.top_logprobs[0]) == 5


def test_non_finite_logits_raise_instead_of_reporting_nan():
    """A row whose logits are NaN (a broken forward) must not become a NaN log-prob."""
    logits = torch.randn(2, 10)
    logits[1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        sample(logits, [RowParams(1.0, 1.0, 0, None, 0)] * 2)

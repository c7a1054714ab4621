"""Batched sampling that reports the log-probs of the distribution actually sampled from.

The trainer corrects for the gap between the policy that sampled a token and the
current one, so the behaviour log-prob must describe the real sampling
distribution: logits divided by the temperature, then restricted by top-k and
top-p and renormalised (what vLLM calls `processed_logprobs`). Greedy rows
(temperature 0) report the plain log-softmax of the logits, as vLLM does.

Sampling inverts each row's CDF with one uniform number per row (softmax, cumsum,
binary search): three cheap passes over the vocabulary, where the exponential-race
trick needs one random number per vocabulary entry (≈8× slower on a CPU). One
uniform per row also lets every row use its own seeded generator while the rest of
the batch stays vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Sampling settings of one batch row."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    top_logprobs: int


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask (to -inf) tokens outside each row's top-k and nucleus. logits: (B, V) scaled."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    max_k = int(k.max())
    needs_p = bool((top_p < 1.0).any())
    if max_k < vocab and not needs_p:
        # top-k only: threshold at each row's k-th largest value, no full sort.
        values = torch.topk(logits, max_k, dim=-1).values  # (B, max_k)
        kth = values.gather(1, (k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    rank = torch.arange(vocab).unsqueeze(0)
    drop = rank >= k.unsqueeze(1)
    if needs_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep a token while the mass before it is < top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # cumsum rounding must never empty a row
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, rows: list[RowParams]) -> SampleOutput:
    """Draw one token per row. logits: (B, V) float32."""
    greedy = torch.tensor([r.temperature == 0 for r in rows])
    temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows])
    scaled = logits / temperature.unsqueeze(1)
    top_k = torch.tensor([r.top_k for r in rows])
    top_p = torch.tensor([r.top_p for r in rows])
    filtered = (top_k > 0) | (top_p < 1.0)
    filtered &= ~greedy
    if bool(filtered.any()):
        idx = filtered.nonzero().squeeze(1)
        scaled[idx] = _filter_top_k_top_p(scaled[idx], top_k[idx], top_p[idx])
    probs = torch.softmax(scaled, dim=-1)  # (B, V)
    cdf = probs.cumsum(dim=-1)
    uniform = torch.rand(len(rows), 1)
    for i, r in enumerate(rows):
        if r.generator is not None:
            uniform[i] = torch.rand(1, generator=r.generator)
    # right=True skips zero-probability entries (a filtered token can never be drawn).
    drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    drawn = drawn.clamp_(max=probs.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)
    chosen = probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    want = max(r.top_logprobs for r in rows)
    if want:
        values, ids = torch.topk(torch.log_softmax(scaled, dim=-1), want, dim=-1)
        for i, r in enumerate(rows):
            if r.top_logprobs:
                n = r.top_logprobs
                top[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
    return SampleOutput(tokens.tolist(), chosen.tolist(), top)

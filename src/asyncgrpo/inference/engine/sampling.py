"""Batched sampling that reports the log-probs of the distribution actually sampled from.

The trainer corrects for the gap between the policy that sampled a token and the
current one, so the behaviour log-prob must describe the real sampling
distribution: logits divided by the temperature, then restricted by top-k and
top-p and renormalised (what vLLM calls `processed_logprobs`). Greedy rows
(temperature 0) report the plain log-softmax of the logits, as vLLM does; so do
rows below `GREEDY_BELOW`, as in vLLM (`_SAMPLING_EPS`).

Sampling inverts each row's CDF with one uniform number per row, where the
exponential-race trick needs one random number per vocabulary entry (≈8× slower on
a CPU). The CDF is searched in two levels — sums of 1024-entry blocks, then the
running sum inside the chosen block — so the only full passes over the vocabulary
are max, exp and the block sums, all in place in one working buffer (a full
cumulative sum, an argmax and fresh softmax buffers cost ≈2.5× more per step).
One uniform per row lets every row use its own seeded generator while the rest of
the batch stays vectorised.

One request's settings must never break the batch it shares: `RowParams.sanitised`
clamps them where they enter the engine, and a row whose logits are not finite
raises `NonFiniteLogits` rather than reporting NaN, so the scheduler can fail that
request alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncgrpo.base.config.rollout import GREEDY_BELOW
from asyncgrpo.inference.engine.types import MAX_TOP_LOGPROBS


@dataclass
class RowParams:
    """Sampling settings of one batch row."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    top_logprobs: int

    @classmethod
    def sanitised(
        cls,
        temperature: float,
        top_p: float,
        top_k: int,
        generator: torch.Generator | None,
        top_logprobs: int,
        vocab: int,
    ) -> RowParams:
        """Settings no value can make `sample` raise on (the server refuses them first).

        This is the engine's own guard, so a value that slips past the server changes
        only its own row: a top-k outside (0, vocab) means no top-k (2**63 overflowed
        the batch's int64 tensor), a top-p outside (0, 1] no nucleus, a non-finite or
        negative temperature greedy, and at most min(20, vocab) alternatives.
        """
        if not (math.isfinite(temperature) and temperature > 0):
            temperature = 0.0
        top_k = top_k if 0 < top_k < vocab else 0
        top_p = top_p if 0 < top_p <= 1 else 1.0  # NaN compares False: no nucleus
        top_logprobs = max(0, min(top_logprobs, MAX_TOP_LOGPROBS, vocab))
        return cls(temperature, top_p, top_k, generator, top_logprobs)


class NonFiniteLogits(ValueError):
    """Some rows' logits hold NaN or +inf: the forward pass, not the request, is at fault."""


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
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = rank >= k.unsqueeze(1)
    if needs_p:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep a token while the mass before it is < top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False  # cumsum rounding must never empty a row
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


BLOCK = 1024  # vocabulary entries per block of the two-level CDF search


def sample(logits: torch.Tensor, rows: list[RowParams]) -> SampleOutput:
    """Draw one token per row. logits: (B, V) float32, left untouched."""
    b, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    # One working buffer, padded to whole blocks; the padding gets zero probability.
    device = logits.device
    work = torch.empty(b, blocks * BLOCK, device=device)
    work[:, vocab:] = float("-inf")
    # `not t >= GREEDY_BELOW` rather than `t < GREEDY_BELOW`: a NaN temperature is greedy
    temperatures = [r.temperature if r.temperature >= GREEDY_BELOW else 1.0 for r in rows]
    if any(t != 1.0 for t in temperatures):
        divisors = torch.tensor(temperatures, device=device).unsqueeze(1)
        torch.div(logits, divisors, out=work[:, :vocab])
    else:
        work[:, :vocab] = logits
    greedy = [i for i, r in enumerate(rows) if not r.temperature >= GREEDY_BELOW]
    filtered = [
        i
        for i, r in enumerate(rows)
        if r.temperature >= GREEDY_BELOW and (r.top_k > 0 or r.top_p < 1.0)
    ]
    if filtered:
        idx = torch.tensor(filtered, device=device)
        top_k = torch.tensor([rows[i].top_k for i in filtered], device=device)
        top_p = torch.tensor([rows[i].top_p for i in filtered], device=device)
        work[idx, :vocab] = _filter_top_k_top_p(work[idx, :vocab], top_k, top_p)
    # Unnormalised probabilities in place: exp(x - max) never overflows.
    weights = work.sub_(work.amax(dim=-1, keepdim=True)).exp_()
    block_cdf = weights.view(b, blocks, BLOCK).sum(dim=-1).cumsum_(dim=-1)  # (B, blocks)
    total = block_cdf[:, -1:]
    _require_finite(total)  # before any seeded generator is drawn from
    uniform = torch.rand(b, 1)  # on the host: a seed draws the same numbers on every device
    for i, r in enumerate(rows):
        if r.generator is not None:
            uniform[i] = torch.rand(1, generator=r.generator)
    target = uniform.to(device) * total
    tokens = _invert_cdf(weights.view(b, blocks, BLOCK), block_cdf, target)
    if greedy:
        g = torch.tensor(greedy, device=device)
        tokens[g] = weights[g].argmax(dim=-1)
    log_total = total.log()
    chosen = weights.gather(1, tokens.unsqueeze(1)).log_().sub_(log_total).squeeze(1)
    top: list[list[tuple[int, float]] | None] = [None] * b
    want = max(r.top_logprobs for r in rows)
    if want:
        values, ids = torch.topk(weights[:, :vocab], want, dim=-1)
        values = values.log().sub_(log_total)
        for i, r in enumerate(rows):
            if r.top_logprobs:
                n = r.top_logprobs
                top[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))
    return SampleOutput(tokens.tolist(), chosen.tolist(), top)


def _require_finite(total: torch.Tensor) -> None:
    """Raise NonFiniteLogits unless every row's mass is finite. total: (B, 1).

    A NaN or +inf logit, or a row of -inf, makes the row's mass NaN; with a finite
    mass (at least 1: the largest entry is exp(0)) every reported log-prob is finite.
    One check per step, not per row.
    """
    if not bool(torch.isfinite(total).all()):
        rows = (~torch.isfinite(total)).nonzero()[:, 0].tolist()
        raise NonFiniteLogits(f"non-finite logits (NaN or inf) in batch rows {rows}")


def _invert_cdf(weights: torch.Tensor, block_cdf: torch.Tensor, target: torch.Tensor):
    """Index of the first entry whose running sum exceeds `target`, searched block then entry.

    weights: (B, blocks, BLOCK) non-negative; block_cdf: (B, blocks) running block sums;
    target: (B, 1) in [0, total). Two small searches instead of a cumulative sum over
    the whole vocabulary. A zero-weight entry is never returned: the chosen block has
    positive mass and the target is clamped inside it against rounding.
    """
    b, blocks, size = weights.shape
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # (B, 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    inner = (
        weights[torch.arange(b, device=weights.device), block.squeeze(1)]
        .cumsum(dim=-1)
        .add_(before)
    )  # (B, BLOCK)
    last = inner[:, -1:]
    target = torch.minimum(torch.maximum(target, before), torch.nextafter(last, before))
    entry = torch.searchsorted(inner, target, right=True).clamp_(max=size - 1)
    return (block * size + entry).squeeze(1)

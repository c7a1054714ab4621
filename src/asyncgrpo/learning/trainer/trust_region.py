"""M2PO's second-moment trust region: the tokens a stale batch may not learn from.

ε-clipping bounds each token's ratio, so under staleness it silences the tokens
whose probability moved most, disproportionately high-entropy ones (M2PO: Zheng,
Zhao, Chen 2025, "Prosperity before Collapse"). M2PO bounds a batch statistic
instead, the second moment of the log-ratio over the N loss tokens of the step:

    M2 = (1/N) Σ_t δ_t²,    δ_t = log π_a(y_t) − log π_engine(y_t)

with π_a the policy the step starts from (the proximal policy when the loss is
given one). When M2 > τ (`loss.m2_threshold`), the tokens with the largest δ² are
masked until the M2 of the others is at or below τ. A masked token carries no
policy-gradient term (with β > 0 its KL term stays, as for the tokens a correction
masks, unless `kl_is_correction`); the others are not ε-clipped (`losses.py`) and
keep the behaviour weight of `loss.correction` (`corrections.py`), as in AReaL,
where the mask only narrows the decoupled loss's token mask.

The rule as computed: sort δ² descending, v_1 ≥ … ≥ v_N; k is the least k whose
rest has mean(v_{k+1..N}) ≤ τ (k = N when even the smallest alone exceeds τ); the
cutoff is c = v_k (∞ when k = 0) and a token is masked when δ² ≥ c. A token's fate
depends on its own δ² and one scalar, so any micro-batch or rank that knows c
masks exactly what one full-batch computation masks.

Where this departs from the anchors, and why:
- AReaL (`actor.m2_threshold`) computes the mask inside the loss, over whatever
  micro-batch the loss is called on; here it is the whole step's, on every
  micro-batch and rank, the batch statistic of the paper.
- Ties at the cutoff are masked together (AReaL masks those first in its sort
  order): the mask is then a function of the values alone, the same on every rank,
  and dropping more of the largest values never raises the mean of the rest.
- AReaL stops at the first rest whose mean is strictly below τ, and when every
  token exceeds τ keeps the one smallest; here the rest may equal τ, and such a
  step masks every token (its policy term is zero).
- δ is AReaL's (log π_prox − log π_behave, π_prox recomputed before the update):
  asyncgrpo takes one optimizer step per batch, so the policy the step starts from
  is that proximal policy.
- The authors' released code (a verl fork) clips instead of masking: over the
  tokens whose ratio moved the way their advantage pushes, it finds the cap on
  |δ| at which their capped M2 meets the budget and clips the ratio there (never
  tighter than fixed minimum ranges). We follow the paper's masking rule, as AReaL
  ships it.
- τ = 0.04 by default: the budget of the authors' scripts and of AReaL's example.

Cost of an exact whole-batch mask: when the step is one micro-batch on one rank,
the loss computes the mask from the log-probs its forward already has (free).
Otherwise the trainer first runs a no-grad forward over its share
(`policy_trainer.step_mask`: about a third of the compute of a forward and
backward) and, with several ranks, all-gathers every loss token's δ² (8 bytes a
token, against the gradients' all-reduce of 4 bytes a parameter), so that each
rank sorts the same values and finds the same cutoff; the mask then reaches each
micro-batch as the datums' `trust_keep` input.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from asyncgrpo.learning.trainer.datums import TrainDatum

Gather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's 1-D values, concatenated in rank order (a collective)."""


def m2_cutoff(squares: torch.Tensor, threshold: float) -> float:
    """The smallest squared log-ratio the trust region masks (δ² ≥ it is masked); ∞ when
    the mean of `squares` (the whole step's, 1-D) is already at or below `threshold`."""
    n = squares.numel()
    if n == 0:
        return math.inf
    values = squares.detach().double().sort(descending=True).values  # (N,)
    counts = torch.arange(n, 0, -1, dtype=torch.float64, device=values.device)  # (N,)
    rest_mean = values.flip(0).cumsum(0).flip(0) / counts  # (N,) mean of values[k:]
    below = torch.nonzero(rest_mean <= threshold)
    k = int(below[0]) if below.numel() else n
    return math.inf if k == 0 else float(values[k - 1])


def m2_metrics(squares: torch.Tensor, cutoff: float) -> dict[str, float]:
    """`m2_before` (mean δ² of the step's loss tokens), `m2_after` (of those kept; NaN when
    none is) and `m2_masked_fraction`; NaN when there are no loss tokens."""
    if squares.numel() == 0:
        return dict(m2_before=math.nan, m2_after=math.nan, m2_masked_fraction=math.nan)
    values = squares.detach().double()
    kept = values < cutoff
    after = float(values[kept].mean()) if bool(kept.any()) else math.nan
    return dict(
        m2_before=float(values.mean()),
        m2_after=after,
        m2_masked_fraction=1.0 - float(kept.double().mean()),
    )


def m2_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float):
    """(keep (B, T) bool, metrics) of the trust region over these tokens alone (the call is
    the whole step); `log_ratio` (B, T) is δ, `mask` (B, T) bool the loss tokens."""
    squares = log_ratio.detach().double().square()  # (B, T)
    values = squares[mask]  # (N,)
    cutoff = m2_cutoff(values, threshold)
    return mask & (squares < cutoff), m2_metrics(values, cutoff)


def whole_batch_keep(
    datums: Sequence[TrainDatum],
    current: Sequence[torch.Tensor],
    threshold: float,
    gather: Gather | None = None,
) -> tuple[list[TrainDatum], dict[str, float]]:
    """The datums with the step's mask as their `trust_keep` input (1.0: kept), and the
    step's M2 metrics. `current`: each datum's (num_targets,) log-probs under the policy
    the step starts from; `gather`: with several ranks, all of them, in rank order."""
    squares, losses = [], []
    for datum, logprobs in zip(datums, current, strict=True):
        engine = torch.as_tensor(datum.inputs["engine_logprobs"], dtype=torch.float64)
        loss_tokens = torch.as_tensor(datum.inputs["mask"]) != 0  # (num_targets,)
        squares.append((logprobs.detach().double().cpu() - engine).square())
        losses.append(loss_tokens)
    local = torch.cat([sq[m] for sq, m in zip(squares, losses, strict=True)] + [_empty()])
    values = gather(local) if gather is not None else local  # (N,) the whole step's
    cutoff = m2_cutoff(values, threshold)
    kept = [
        dataclasses.replace(datum, inputs={**datum.inputs, "trust_keep": (m & (sq < cutoff))})
        for datum, sq, m in zip(datums, squares, losses, strict=True)
    ]
    return kept, m2_metrics(values, cutoff)


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.float64)

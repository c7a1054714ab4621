"""Behaviour-policy corrections: how much a token sampled by the engine counts for the trainer.

In asynchronous training the engine (π_engine, the behaviour policy) sampled a
token with weights that may be several versions old, and even with the same
weights its kernels differ from the trainer's. The loss therefore multiplies
each token's policy-gradient term by a detached weight w computed from the
anchor policy π_a (π_old, or the proximal policy when one is given) and the
engine's log-probs, ρ = π_a / π_engine:

- `token_truncate`:    w_t = min(ρ_t, C)                        (truncated IS)
- `token_mask`:        w_t = 1 if 1/C ≤ ρ_t ≤ C else 0            (rejection)
- `sequence_truncate`: w_i = min(ρ_i, C),                ρ_i = Π_t ρ_t = exp(Σ_t log ρ_t)
- `sequence_mask`:     w_i = 1 if 1/C ≤ ρ_i ≤ C else 0
- `masked_is`:         w_t = ρ_t if α ≤ ρ_t ≤ β else 0            (IcePop, masked IS)
- `none`:              w = 1

Choices, stated because the anchors differ:

- Sequence ratios are the product of token ratios (exp of the *summed*
  log-ratio, as AReaL and verl do), not GSPO's length-normalised mean: the
  product is the true likelihood ratio of the sampled sequence.
- Mask modes are two-sided and binary: a token (sequence) whose ratio leaves
  [1/C, C] gets weight exactly 0 — never clamped back to C or 1/C — and one
  inside gets weight 1. A token the trainer finds much *less* likely than the
  engine did is as off-policy as one it finds much more likely.
- `masked_is` is IcePop's masked importance weight (Ring-1T report:
  M(ρ) = ρ·1[α ≤ ρ ≤ β], α = 0.5 and β = 5 there, our defaults), which is also
  TRL's `token_mask`. Unlike `token_mask` above, its band is asymmetric and
  explicit (`masked_is_low`, `masked_is_high`, not [1/C, C]) and a token inside
  keeps its weight ρ (an importance-sampling correction) instead of 1. A token
  outside carries no gradient on either side: never clamped back to α or β, as
  `token_truncate` clamps to C. IcePop's ρ compares trainer and engine under the
  same weights; here, as in every mode, π_a may be versions ahead of the engine,
  so ρ carries the staleness too. (verl's masked-IS presets reject sequences
  outside [0.5, 2] and weigh the rest by a separately truncated ratio.)
- Comparisons are made in log space (log ρ ≤ log C), so nothing overflows for
  extreme ratios, and ρ = 1 gives w = 1 exactly.
- Padding (mask False) always gets weight 0.

Off-policy sequence masking (OPSM, DeepSeek-V3.2): a sequence is dropped when
its advantage is negative and the mean over its tokens of
log(π_engine/π_θ) = lp_engine − lp_θ (a k1 estimate of KL(π_engine‖π_θ)) is
greater than δ. It is decided per sequence on detached values.
"""

from __future__ import annotations

import math

import torch

CORRECTIONS = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "masked_is",
)
"""Public correction modes (`LossConfig.correction`)."""


def masked_difference(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a − b where mask, 0 elsewhere (padding may hold garbage, even NaN)."""
    return torch.where(mask, a - b, torch.zeros((), dtype=a.dtype, device=a.device))


def behaviour_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    band: tuple[float, float] = (0.5, 5.0),
) -> torch.Tensor:
    """Detached per-token weights (B, T) from log ρ = log π_a − log π_engine (0 at padding).

    `mode` is one of CORRECTIONS, or `raw` (w = ρ uncapped: decoupled PPO without a cap);
    `band`: (α, β) of `masked_is`.
    """
    log_ratio = log_ratio.detach()  # (B, T)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    if mode == "none":
        return mask.to(log_ratio.dtype)
    if mode == "raw":
        return torch.where(mask, log_ratio.exp(), zero)
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown correction {mode!r}; expected one of {CORRECTIONS}")
    if mode == "masked_is":
        low, high = math.log(band[0]), math.log(band[1])
        inside = mask & (log_ratio >= low) & (log_ratio <= high)
        return torch.where(inside, log_ratio.clamp(low, high).exp(), zero)
    log_cap = math.log(cap)
    level, kind = mode.split("_")
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # (B, T)
    if kind == "truncate":
        weights = log_ratio.clamp(max=log_cap).exp()
    else:
        weights = ((log_ratio <= log_cap) & (log_ratio >= -log_cap)).to(log_ratio.dtype)
    return torch.where(mask, weights, zero)


def opsm_keep(
    engine_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """(B,) bool: False for sequences OPSM drops (advantage < 0 and mean log(π_engine/π_θ) > δ)."""
    diff = masked_difference(engine_logprobs.detach(), logprobs.detach(), mask)  # (B, T)
    count = mask.sum(dim=-1)  # (B,)
    mean_kl = diff.sum(dim=-1) / count.clamp(min=1)  # (B,)
    drop = (advantages.detach().view(-1) < 0) & (mean_kl > delta) & (count > 0)
    return ~drop


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimator exp(x) − x − 1 of KL, with x = log(q/p) for samples drawn from p (≥ 0)."""
    return torch.expm1(log_ratio) - log_ratio

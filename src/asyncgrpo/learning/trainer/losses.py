"""The GRPO loss family as one pure function: `compute_loss(LossInputs, LossConfig)`.

`LossConfig` is the recipe's `loss` section (`asyncgrpo.base.config`, re-exported here):
the trainer receives it as validated, and its field names are the ones used below.

Per token t of sequence i (mask True), with advantage A_i:

    loss_it = w_it · keep_i · m_it · surrogate_it
              + β · k3_it · [w_it · m_it · r_it if kl_is_correction]

and the loss is an aggregation of loss_it. The pieces:

- ratio r_it = π_θ/π_c with centre π_c = π_old (`clipped`, `cispo`) or the
  proximal policy (`decoupled_ppo`). `old_logprobs=None` means π_old is the
  engine's log-probs (TRL's async trainer: ratio against the sampler, so the
  behaviour weight is 1); the trainer loop passes `logprobs.detach()` for its
  default one-step-per-batch mode. At `ratio_level="sequence"` (GSPO) the
  ratio is s_i = exp(mean_t log r_it), broadcast to tokens in the
  straight-through form sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]: its value is s_i and its
  gradient flows to each token separately (GSPO-token).
- m_it: the trust region's token mask. `trust_region="clip"`: 1, and the surrogates
  below clip the ratio to [1−ε_low, 1+ε_high]. `trust_region="m2"`: M2PO's mask
  (`trust_region.py`: the tokens with the largest squared log-ratio to the engine are
  masked until the step's mean is ≤ `m2_threshold`) and no ε-clipping: `clipped` and
  `decoupled_ppo` become −r̃·A, `cispo` −sg[r]·A·log π_θ (`delta` still caps r̃).
  The mask is the whole step's: `LossInputs.trust_keep` carries it to each
  micro-batch; left None, it is computed over this call's tokens. Like the
  correction's zero weights, masked tokens stay in the aggregation's counts.
- surrogates (registry `LOSSES`, chosen by `LossConfig.name`):
  `clipped`: −min(r̃·A, clip(r, 1−ε_low, 1+ε_high)·A) with r̃ = min(r, δ) for
  A < 0 when `delta` is set (two-sided clipping), else r̃ = r.
  `cispo`: −sg[clip(r, 1−ε_low, 1+ε_high)]·A·log π_θ (MiniMax-M1; every token
  keeps a gradient, only its weight is clipped; set ε_low ≥ 1 for no lower bound).
  `decoupled_ppo` (AReaL): the clipped surrogate centred on π_prox
  (`proximal_logprobs`, falling back to π_old); the behaviour weight
  π_prox/π_engine is part of the objective, so `correction="none"` means the
  uncapped weight and the other modes cap or mask it with `correction_cap`
  (`masked_is`: with its band).
- w_it: behaviour weight of `corrections.py` from π_anchor/π_engine, where the
  anchor is π_prox when given, else π_old.
- keep_i: OPSM (`opsm_delta`), see `corrections.py`.
- k3_it = exp(ref − lp) − (ref − lp) − 1 against a reference model (β > 0).
  With `kl_is_correction` it is weighted by the detached IS ratio π_θ/π_engine
  (π_θ/π_anchor times w·m, so truncation and masks apply to it too); OPSM does not drop
  it, nor does the M2 mask without `kl_is_correction`.

Aggregation over tokens, normalised by counts of the *whole optimizer step*
so that summing the losses of micro-batches equals the loss of the batch
(exact gradient accumulation). W = dp_world_size. Each rank returns its
contribution; data-parallel all-reduce *averages* gradients, so contributions
are scaled by W and the averaged gradient is that of the global loss:

- `dapo`:    W · Σ_it loss_it / num_global_tokens   (global token mean)
- `grpo`:    W · Σ_i (Σ_t loss_it / |y_i|) / num_global_sequences
- `dr_grpo`: W · Σ_it loss_it / (num_global_sequences · max_completion_length)
- `bnpo`:    W · Σ_it loss_it / num_batch_tokens, with num_batch_tokens the loss tokens
  of the step's whole batch (all ranks, all micro-batches). asyncgrpo takes one
  optimizer step per batch, so this equals `dapo`; TRL's bnpo normalises each rank by
  its own tokens instead, which makes the gradient depend on the number of ranks.

Counts left None default to those of this call (the call is the whole batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncgrpo.base.config import LossConfig
from asyncgrpo.learning.trainer.corrections import (
    behaviour_weights,
    k3,
    masked_difference,
    opsm_keep,
)
from asyncgrpo.learning.trainer.trust_region import m2_keep

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # (B, T) current policy, with grad
    engine_logprobs: torch.Tensor  # (B, T) behaviour policy (the sampler)
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) bool or float: tokens that carry loss
    old_logprobs: torch.Tensor | None = None  # (B, T) π_old; None: the engine's
    ref_logprobs: torch.Tensor | None = None  # (B, T) reference model (β > 0)
    entropy: torch.Tensor | None = None  # (B, T) for the metric only
    proximal_logprobs: torch.Tensor | None = None  # (B, T) π_prox (decoupled PPO)
    trust_keep: torch.Tensor | None = None  # (B, T) the whole step's M2 mask; None: this call's
    num_global_tokens: float | None = None  # loss tokens of the whole step, all ranks
    num_batch_tokens: float | None = None  # loss tokens of the step's batch, all ranks (bnpo)
    num_global_sequences: float | None = None  # sequences of the whole step, all ranks
    max_completion_length: float | None = None  # dr_grpo's constant length
    dp_world_size: int = 1


@dataclass
class Surrogate:
    per_token: torch.Tensor  # (B, T) loss to minimise, before weights
    clipped_low: torch.Tensor  # (B, T) bool
    clipped_high: torch.Tensor  # (B, T) bool
    clipped_delta: torch.Tensor  # (B, T) bool


SurrogateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], Surrogate]


@dataclass(frozen=True)
class LossSpec:
    surrogate: SurrogateFn
    centre: str  # "old" | "proximal": the policy the ratio is taken against
    intrinsic_weight: bool  # the behaviour weight is part of the objective (decoupled PPO)


def clip_range(cfg: LossConfig) -> tuple[float, float]:
    """The ε-clip range of the ratio; (0, ∞), no clipping, under the M2 trust region."""
    if cfg.trust_region == "m2":
        return 0.0, math.inf
    return 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high


def clipped_surrogate(ratio, logprobs, adv, cfg: LossConfig) -> Surrogate:
    """−min(r̃·A, clip(r)·A), or −r̃·A without a clip range; ratio (B, T), adv (B, 1)."""
    lower, upper = clip_range(cfg)
    unclipped = ratio
    r = ratio.detach()
    negative = adv < 0  # (B, 1)
    clipped_delta = torch.zeros_like(r, dtype=torch.bool)
    if cfg.delta is not None:
        unclipped = torch.where(negative, ratio.clamp(max=cfg.delta), ratio)
        clipped_delta = negative & (r > cfg.delta)
    objective = unclipped * adv
    if math.isfinite(upper):
        objective = torch.minimum(objective, ratio.clamp(lower, upper) * adv)
    return Surrogate(
        per_token=-objective,
        clipped_low=negative & (r < lower),
        clipped_high=(adv > 0) & (r > upper),
        clipped_delta=clipped_delta,
    )


def cispo_surrogate(ratio, logprobs, adv, cfg: LossConfig) -> Surrogate:
    """−sg[clip(r)]·A·log π_θ; 'clipped' counts tokens whose weight was clipped."""
    lower, upper = clip_range(cfg)
    r = ratio.detach()
    return Surrogate(
        per_token=-(r.clamp(lower, upper) * adv) * logprobs,
        clipped_low=r < lower,
        clipped_high=r > upper,
        clipped_delta=torch.zeros_like(r, dtype=torch.bool),
    )


# `config/training.py:LOSS_NAMES` lists these keys for recipe validation; keep the two equal.
LOSSES: dict[str, LossSpec] = {
    "clipped": LossSpec(clipped_surrogate, centre="old", intrinsic_weight=False),
    "cispo": LossSpec(cispo_surrogate, centre="old", intrinsic_weight=False),
    "decoupled_ppo": LossSpec(clipped_surrogate, centre="proximal", intrinsic_weight=True),
}


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def policy_ratio(logprobs, centre, mask, active, level: str) -> torch.Tensor:
    """(B, T) ratio π_θ/π_c: per token, or GSPO's straight-through sequence ratio.

    Tokens outside `active` get ratio 1 per token (s_i at sequence level) and no gradient.
    """
    if level == "token":
        return masked_difference(logprobs, centre, active).exp()
    log_ratio = masked_difference(logprobs.detach(), centre, mask)  # (B, T)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    token_factor = masked_difference(logprobs, logprobs.detach(), active)  # (B, T), value 0
    return (seq_log_ratio + token_factor).exp()


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, inputs: LossInputs, how: str):
    """Scalar loss contribution of this call, normalised by whole-step counts."""
    tokens = float(mask.sum())
    world = float(inputs.dp_world_size)
    sequences = _count(inputs.num_global_sequences, float(mask.shape[0]))
    if how == "dapo":
        return per_token.sum() * (world / _count(inputs.num_global_tokens, tokens))
    if how == "bnpo":
        return per_token.sum() * (world / _count(inputs.num_batch_tokens, tokens))
    if how == "dr_grpo":
        length = _count(inputs.max_completion_length, float(mask.shape[-1]))
        return per_token.sum() * (world / (sequences * length))
    if how == "grpo":
        lengths = mask.sum(-1).clamp(min=1).to(per_token.dtype)  # (B,)
        return (per_token.sum(-1) / lengths).sum() * (world / sequences)
    raise ValueError(f"unknown aggregation {how!r}; expected one of {AGGREGATIONS}")


def _count(value: float | None, default: float) -> float:
    return max(float(default if value is None else value), 1.0)


def compute_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """(scalar loss with grad, float metrics). Pure: no state, no in-place edits of inputs."""
    spec = get_loss(cfg.name)
    lp = inputs.logprobs  # (B, T)
    dtype = lp.dtype
    mask = inputs.mask.bool()  # (B, T)
    engine = inputs.engine_logprobs.detach().to(dtype)  # (B, T)
    old = engine if inputs.old_logprobs is None else inputs.old_logprobs.detach().to(dtype)
    prox = inputs.proximal_logprobs
    anchor = old if prox is None else prox.detach().to(dtype)  # (B, T)
    centre = anchor if spec.centre == "proximal" else old
    adv = inputs.advantages.detach().to(dtype).view(-1, 1)  # (B, 1)

    mode = "raw" if spec.intrinsic_weight and cfg.correction == "none" else cfg.correction
    band = (cfg.masked_is_low, cfg.masked_is_high)
    weights = behaviour_weights(
        masked_difference(anchor, engine, mask), mask, mode, cfg.correction_cap, band
    )
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)  # (B,)
    if cfg.opsm_delta is not None:
        keep = opsm_keep(engine, lp, mask, adv, cfg.opsm_delta)
    region, region_metrics = trust_region_mask(inputs, mask, cfg)  # (B, T) bool
    kept_weights = weights * region.to(dtype)  # (B, T) w·m
    coef = kept_weights * keep.view(-1, 1).to(dtype)  # (B, T)
    active = mask & (coef != 0)  # (B, T) tokens that carry policy gradient

    ratio = policy_ratio(lp, centre, mask, active, cfg.ratio_level)  # (B, T)
    surrogate = spec.surrogate(ratio, lp, adv, cfg)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    per_token = torch.where(active, surrogate.per_token * coef, zero)  # (B, T)
    kl = None
    if cfg.beta > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("LossConfig.beta > 0 needs LossInputs.ref_logprobs")
        ref = inputs.ref_logprobs.detach().to(dtype)
        kl = k3(masked_difference(ref, lp, mask))  # (B, T), 0 at padding
        kl_coef = mask.to(dtype)
        if cfg.kl_is_correction:  # π_θ/π_anchor · w·m: π_θ/π_engine truncated or masked like w
            to_anchor = masked_difference(lp.detach(), anchor, mask).exp()
            kl_coef = torch.where(kept_weights != 0, to_anchor * kept_weights, zero)
        per_token = per_token + cfg.beta * torch.where(mask, kl * kl_coef, zero)
    loss = aggregate(per_token, mask, inputs, cfg.aggregation)
    metrics = loss_metrics(inputs, mask, active, ratio, surrogate, weights, keep, kl, cfg)
    return loss, metrics | region_metrics


def trust_region_mask(inputs: LossInputs, mask: torch.Tensor, cfg: LossConfig):
    """((B, T) bool: the loss tokens the trust region lets carry policy gradient, the M2
    metrics when this call computes the mask: `trust_keep` not given, the call is the step).

    δ is taken from the policy the step starts from: π_prox when given, else π_θ's values."""
    if cfg.trust_region != "m2":
        return mask, {}
    if inputs.trust_keep is not None:
        return mask & inputs.trust_keep.bool(), {}
    start = inputs.logprobs if inputs.proximal_logprobs is None else inputs.proximal_logprobs
    engine = inputs.engine_logprobs.detach().double()
    log_ratio = masked_difference(start.detach().double(), engine, mask)  # (B, T)
    return m2_keep(log_ratio, mask, cfg.m2_threshold)


@torch.no_grad()
def loss_metrics(
    inputs, mask, active, ratio, surrogate, weights, keep, kl, cfg
) -> dict[str, float]:
    """Per-call metrics; NaN where nothing was counted.

    Clip fractions are over the tokens that carry policy gradient (`active`);
    weight statistics and `masked_fraction` (weight 0 from the correction) over
    all loss tokens (`is_weight_sq_mean`, the mean of w², makes the effective sample
    size per token mean(w)²/mean(w²): exact across micro-batches and ranks, whose
    metrics merge weighted by loss tokens); `opsm_drop_ratio` over non-empty sequences; `mismatch_kl`
    is the k3 estimate of KL(π_engine‖π_θ) per token, exp(x) − x − 1 with
    x = lp_θ − lp_engine, averaged over loss tokens (≥ 0, unbiased under the sampler).
    """
    lower, upper = clip_range(cfg)
    r = ratio.detach()
    low, high, dclip = (
        x & active for x in (surrogate.clipped_low, surrogate.clipped_high, surrogate.clipped_delta)
    )
    engine = inputs.engine_logprobs.detach().to(r.dtype)
    mismatch = k3(masked_difference(inputs.logprobs.detach(), engine, mask))
    non_empty = mask.any(-1)  # (B,)
    out = {
        "clip_ratio": _mean(low | high | dclip, active),
        "clip_ratio_low": _mean(low, active),
        "clip_ratio_high": _mean(high, active),
        "clip_ratio_delta": _mean(dclip, active),
        "clip_ratio_region": _mean((r < lower) | (r > upper), active),
        "is_weight_min": _reduce(weights, mask, torch.amin),
        "is_weight_mean": _mean(weights, mask),
        "is_weight_max": _reduce(weights, mask, torch.amax),
        # with the mean, the effective sample size per loss token: mean(w)² / mean(w²)
        "is_weight_sq_mean": _mean(weights.detach().square(), mask),
        "masked_fraction": _mean(weights == 0, mask),
        "opsm_drop_ratio": _mean(~keep, non_empty),
        "mismatch_kl": _mean(mismatch, mask),
    }
    if inputs.entropy is not None:
        out["entropy"] = _mean(inputs.entropy.detach(), mask)
    if kl is not None:
        out["kl"] = _mean(kl, mask)
    return out


def _mean(values: torch.Tensor, where: torch.Tensor) -> float:
    count = int(where.sum())
    if count == 0:
        return math.nan
    return float(torch.where(where, values.to(torch.float64), 0.0).sum()) / count


def _reduce(values: torch.Tensor, where: torch.Tensor, op) -> float:
    if not bool(where.any()):
        return math.nan
    return float(op(values[where]))

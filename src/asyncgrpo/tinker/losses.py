"""The Tinker API's built-in losses, as pure functions over padded per-token tensors.

Tinker's losses differ from the GRPO recipe's (`trainer/losses.py`) on purpose: every
term is SUM-reduced over tokens and datums, with no normalisation, and nothing is masked
except through the client's own numbers (a zero advantage or weight) and the padding of
a micro-batch. So a loss over several micro-batches or calls is the sum of their losses,
and the gradient a client asks for is exactly the one it gets. Definitions, with `tlp`
the learner's log-prob of each target token, `slp` the sampler's (`logprobs` input), `A`
the advantages and `r = exp(tlp - slp)` (Tinker's documented losses, as SDK 0.38 names
them and their `loss_fn_config` keys):

- `cross_entropy`: -Σ tlp·weights (weights may be negative);
- `importance_sampling`: -Σ r·A;
- `ppo`: -Σ min(r·A, clip(r, lo, hi)·A), `clip_low_threshold` / `clip_high_threshold`
  (ratio bounds, default 0.8 / 1.2);
- `cispo`: -Σ sg[clip(r, lo, hi)]·tlp·A, default bounds 0 / 4 (the cookbook's tutorial:
  one-sided, only the upper side capped);
- `dro`: -Σ (tlp·A - ½·β·(tlp - slp)²), `beta` required (the docs give no default);
- `gspo`: per datum, the sequence log-ratio s = mean over `sequence_ratio_mask` of
  sg(tlp) - slp (0 for an empty mask), r = exp(s + tlp - sg(tlp)) (the value of the
  sequence ratio, the gradient of a token ratio), then PPO's clipped objective.

A ratio is only formed where a token carries loss (advantage non-zero, not padding):
elsewhere it is 1, so an extreme sampler log-prob under a zero advantage cannot turn
0·inf into NaN. Where it is finite this changes nothing.

Metrics are named `name:reduction` as the SDK merges them: `loss:sum` always, and for
the clipped losses `clip_fraction:mean`, the share of loss-carrying tokens whose ratio
lies outside [lo, hi] (`MetricTotals` sums numerators and counts across micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from asyncgrpo.tinker.errors import TinkerUserError

LOSS_FN_FIELD = "forward_backward_input.loss_fn"
CONFIG_FIELD = "forward_backward_input.loss_fn_config"

Tensors = dict[str, torch.Tensor]


@dataclass
class MetricTotals:
    """Metric sums over micro-batches: `name:sum` values, and `name:mean` as total/count."""

    sums: dict[str, float] = field(default_factory=dict)
    means: dict[str, tuple[float, float]] = field(default_factory=dict)

    def add_sum(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value

    def add_mean(self, name: str, total: float, count: float) -> None:
        old_total, old_count = self.means.get(name, (0.0, 0.0))
        self.means[name] = (old_total + total, old_count + count)

    def merge(self, other: MetricTotals) -> None:
        for name, value in other.sums.items():
            self.add_sum(name, value)
        for name, (total, count) in other.means.items():
            self.add_mean(name, total, count)

    def result(self) -> dict[str, float]:
        """`name:reduction` -> value; a mean over no items is 0."""
        out = {f"{name}:sum": value for name, value in self.sums.items()}
        for name, (total, count) in self.means.items():
            out[f"{name}:mean"] = total / count if count else 0.0
        return out


@dataclass(frozen=True)
class TinkerLoss:
    """One loss with its config resolved: call it on a padded micro-batch.

    `inputs`: the float `loss_fn_inputs` it reads (besides `target_tokens`, which chose
    the learner log-probs). `config`: every config number it uses, defaults filled in.
    """

    name: str
    inputs: tuple[str, ...]
    config: dict[str, float]
    objective: Callable[[torch.Tensor, torch.Tensor, Tensors, dict[str, float]], Terms]

    def __call__(
        self, logprobs: torch.Tensor, mask: torch.Tensor, inputs: Tensors
    ) -> tuple[torch.Tensor, MetricTotals]:
        """(scalar loss, metrics) of `logprobs` (B, T) with grad, `mask` (B, T) 1 on target
        positions and 0 on padding, `inputs` each (B, T), zero-padded."""
        terms = self.objective(logprobs, mask, inputs, self.config)
        loss = -(terms.objective * mask).sum()
        metrics = MetricTotals()
        metrics.add_sum("loss", float(loss.detach()))
        if terms.clipped is not None:
            active = terms.active
            metrics.add_mean(
                "clip_fraction", float((terms.clipped * active).sum()), float(active.sum())
            )
        return loss, metrics


@dataclass
class Terms:
    """Per-token objective (B, T) (to maximise), and for the clipped losses which tokens
    carry loss and which had their ratio clipped (both (B, T) float, detached)."""

    objective: torch.Tensor
    active: torch.Tensor | None = None
    clipped: torch.Tensor | None = None


def _active(mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """(B, T) 1.0 where a token carries loss: a target position with a non-zero advantage."""
    return mask * (advantages != 0)


def _token_ratio(logprobs, mask, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, active): r = exp(tlp - slp) where active, else exactly 1 (no grad)."""
    active = _active(mask, inputs["advantages"])
    log_ratio = torch.where(active > 0, logprobs - inputs["logprobs"], 0.0)  # (B, T)
    return torch.exp(log_ratio), active


def _clip_terms(ratio, active, advantages, config) -> Terms:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    clipped_ratio = ratio.clamp(low, high)
    objective = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio.detach() < low) | (ratio.detach() > high)).float()
    return Terms(objective, active, clipped)


def cross_entropy(logprobs, mask, inputs, config) -> Terms:
    return Terms(logprobs * inputs["weights"])


def importance_sampling(logprobs, mask, inputs, config) -> Terms:
    ratio, _ = _token_ratio(logprobs, mask, inputs)
    return Terms(ratio * inputs["advantages"])


def ppo(logprobs, mask, inputs, config) -> Terms:
    ratio, active = _token_ratio(logprobs, mask, inputs)
    return _clip_terms(ratio, active, inputs["advantages"], config)


def cispo(logprobs, mask, inputs, config) -> Terms:
    ratio, active = _token_ratio(logprobs, mask, inputs)
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    coefficient = ratio.detach().clamp(low, high)
    clipped = ((ratio.detach() < low) | (ratio.detach() > high)).float()
    return Terms(coefficient * logprobs * inputs["advantages"], active, clipped)


def dro(logprobs, mask, inputs, config) -> Terms:
    penalty = (logprobs - inputs["logprobs"]) ** 2
    return Terms(logprobs * inputs["advantages"] - 0.5 * config["beta"] * penalty)


def gspo(logprobs, mask, inputs, config) -> Terms:
    seq_mask = inputs["sequence_ratio_mask"] * mask  # (B, T)
    detached = logprobs.detach()
    counts = seq_mask.sum(dim=1)  # (B,)
    seq_log_ratio = ((detached - inputs["logprobs"]) * seq_mask).sum(dim=1) / counts.clamp(min=1)
    active = _active(mask, inputs["advantages"])
    log_ratio = seq_log_ratio[:, None] + logprobs - detached  # (B, T)
    ratio = torch.exp(torch.where(active > 0, log_ratio, 0.0))
    return _clip_terms(ratio, active, inputs["advantages"], config)


_RL = ("logprobs", "advantages")
_CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class _Spec:
    objective: Callable
    inputs: tuple[str, ...]
    defaults: dict[str, float | None]  # None: required


LOSSES: dict[str, _Spec] = {
    "cross_entropy": _Spec(cross_entropy, ("weights",), {}),
    "importance_sampling": _Spec(importance_sampling, _RL, {}),
    "ppo": _Spec(ppo, _RL, dict(zip(_CLIP_KEYS, (0.8, 1.2), strict=True))),
    "cispo": _Spec(cispo, _RL, dict(zip(_CLIP_KEYS, (0.0, 4.0), strict=True))),
    "dro": _Spec(dro, _RL, {"beta": None}),
    "gspo": _Spec(
        gspo, (*_RL, "sequence_ratio_mask"), dict(zip(_CLIP_KEYS, (0.8, 1.2), strict=True))
    ),
}
"""Each served loss: its objective, the float inputs it reads, its config keys' defaults."""


def make_loss(name: str, config: Mapping[str, float | str] | None = None) -> TinkerLoss:
    """The loss `name` with `config` checked and its defaults filled in; a
    `TinkerUserError` naming the field for an unknown loss, key or bad value."""
    spec = LOSSES.get(name)
    if spec is None:
        raise TinkerUserError(LOSS_FN_FIELD, _unknown_loss(name))
    given = dict(config or {})
    for key in given:
        if key not in spec.defaults:
            reads = ", ".join(spec.defaults) or "no config"
            raise TinkerUserError(
                f"{CONFIG_FIELD}.{key}", f"is not read by loss_fn {name!r}, which reads {reads}"
            )
    resolved = {}
    for key, default in spec.defaults.items():
        value = given.get(key, default)
        if value is None:
            raise TinkerUserError(f"{CONFIG_FIELD}.{key}", f"loss_fn {name!r} needs it")
        resolved[key] = _finite(key, value)
    _check_ranges(resolved)
    return TinkerLoss(name, spec.inputs, resolved, spec.objective)


def _unknown_loss(name: str) -> str:
    served = ", ".join(LOSSES)
    if name == "stable_reinforce":
        return (
            "'stable_reinforce' is not served (its objective is not public); use "
            "'importance_sampling' (the cookbook's choice) or 'ppo'"
        )
    return f"{name!r} is not a served loss; the losses are {served}"


def _finite(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TinkerUserError(f"{CONFIG_FIELD}.{key}", f"must be a finite number, got {value!r}")
    return float(value)


def _check_ranges(config: dict[str, float]) -> None:
    if "clip_low_threshold" in config:
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        if not 0 <= low <= high:
            raise TinkerUserError(
                CONFIG_FIELD,
                f"the clip thresholds bound the ratio: need 0 <= clip_low_threshold ({low}) "
                f"<= clip_high_threshold ({high})",
            )
    if config.get("beta", 0.0) < 0:
        raise TinkerUserError(f"{CONFIG_FIELD}.beta", "must not be negative")

"""Group-relative advantages from one or more reward functions, NaN aware.

The one place advantages are computed, as pure functions that return values
and change no rollout: the group builders ask `is_zero_variance` of each group
as it is scored, the trainer asks `batch_advantages` of its batch, and the
metric rows report the combined rewards of the same result, so streaming and
batch scoring cannot disagree. Its options are the recipe's `advantage`
section, `asyncgrpo.base.config.AdvantageConfig` (re-exported here).

For each sample, `rewards` holds one entry per reward function; `None` or NaN
means that function gave no reward for it. With weights w_f (`reward_weights`,
default 1):

- `combine="sum_then_normalize"` (default): the sample's reward is
  R = Σ_f w_f·r_f over the functions that scored it (a missing reward excludes
  that function for that sample; it is not read as 0). Advantages are then
  normalised once, on R.
- `combine="normalize_then_sum"` (GDPO-style): each function's rewards are
  normalised on their own over the samples it scored, and the advantage is
  Σ_f w_f·Â_f over the available functions. There is no second normalisation
  of the sum. The reported reward is still R.

Normalising values x within their group g (over the valid samples only):
Â = (x − mean_g) / (std + ε), std the sample standard deviation (unbiased,
n − 1, as `torch.std`) of the group (`scale_rewards="group"`), of all valid
samples of the batch (`scale_rewards="batch"`; the mean stays the group's), or
no division at all (`scale_rewards="none"`: Â = x − mean_g). ε is `epsilon`
(1e-4 by default).

A sample no function scored is masked: advantage 0, reward NaN, mask False.
A group with fewer than two valid samples, or whose valid values are all
exactly equal, is degenerate: its advantages are 0 (never the raw reward) and
`degenerate` is True. Under `normalize_then_sum` a group is degenerate when it
is so for every function (its advantages are then all 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncgrpo.base.config import AdvantageConfig
from asyncgrpo.learning.rollout.types import Group, Rollout


@dataclass
class AdvantageResult:
    advantages: np.ndarray  # (N,) float64, 0 for masked samples and degenerate groups
    rewards: np.ndarray  # (N,) combined weighted reward, NaN when masked
    mask: np.ndarray  # (N,) bool: at least one function scored the sample
    degenerate: np.ndarray  # (G,) bool, groups in order of first appearance
    group_ids: list[int]  # (G,) the group ids in that order
    group_index: np.ndarray  # (N,) int: each sample's position in `group_ids`
    reward_matrix: np.ndarray  # (N, F) raw rewards, NaN where missing


def compute_advantages(
    rewards: list[list[float | None]],
    group_ids: list[int],
    cfg: AdvantageConfig,
    weights: list[float] | None = None,
) -> AdvantageResult:
    """Advantages of N samples from their per-function rewards and group ids.

    `weights` (one per reward function) default to `cfg.reward_weights`, then to all 1.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} reward rows for {len(group_ids)} group ids")
    matrix = reward_matrix(rewards)  # (N, F)
    n, f = matrix.shape
    weights = cfg.reward_weights if weights is None else weights
    w = np.ones(f) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (f,):
        raise ValueError(f"{len(w)} reward weights for {f} reward functions")
    order = list(dict.fromkeys(group_ids))
    position = {g: i for i, g in enumerate(order)}
    gidx = np.array([position[g] for g in group_ids], dtype=np.int64)  # (N,)
    present = ~np.isnan(matrix)  # (N, F)
    mask = present.any(axis=1)  # (N,)
    combined = np.where(present, matrix * w, 0.0).sum(axis=1)  # (N,)
    combined = np.where(mask, combined, np.nan)
    if cfg.combine == "sum_then_normalize":
        adv, degenerate = normalize(combined, mask, gidx, len(order), cfg)
    else:
        adv = np.zeros(n)
        degenerate = np.ones(len(order), dtype=bool)
        for j in range(f):
            adv_j, degenerate_j = normalize(matrix[:, j], present[:, j], gidx, len(order), cfg)
            adv += w[j] * adv_j
            degenerate &= degenerate_j
        adv = np.where(degenerate[gidx], 0.0, adv)
    return AdvantageResult(adv, combined, mask, degenerate, order, gidx, matrix)


def reward_matrix(rewards: list[list[float | None]]) -> np.ndarray:
    """(N, F) float64 with NaN for None; every row must have the same length."""
    widths = {len(row) for row in rewards}
    if len(widths) > 1:
        raise ValueError(f"reward rows have different lengths {sorted(widths)}")
    f = widths.pop() if widths else 0
    out = np.full((len(rewards), f), np.nan)
    for i, row in enumerate(rewards):
        for j, value in enumerate(row):
            if value is not None:
                out[i, j] = float(value)
    return out


def normalize(
    values: np.ndarray, valid: np.ndarray, gidx: np.ndarray, num_groups: int, cfg: AdvantageConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages (N,), degenerate (G,)) of `values` normalised within groups over `valid`."""
    x = np.where(valid, values, 0.0)  # (N,)
    count = np.bincount(gidx[valid], minlength=num_groups)  # (G,)
    mean = np.bincount(gidx, weights=x, minlength=num_groups) / np.maximum(count, 1)  # (G,)
    high = np.full(num_groups, -np.inf)
    low = np.full(num_groups, np.inf)
    np.maximum.at(high, gidx[valid], values[valid])
    np.minimum.at(low, gidx[valid], values[valid])
    degenerate = (count < 2) | (high == low)  # (G,)
    centred = np.where(valid, values - mean[gidx], 0.0)  # (N,)
    if cfg.scale_rewards == "none":
        adv = centred
    else:
        if cfg.scale_rewards == "group":
            squares = np.bincount(gidx, weights=centred**2, minlength=num_groups)
            std = np.sqrt(squares / np.maximum(count - 1, 1))[gidx]  # (N,)
        else:
            pool = values[valid]
            std = float(pool.std(ddof=1)) if pool.size > 1 else 0.0
        adv = centred / (std + cfg.epsilon)
    adv = np.where(valid & ~degenerate[gidx], adv, 0.0)
    return adv, degenerate


def batch_advantages(groups: list[Group], cfg: AdvantageConfig) -> AdvantageResult:
    """The advantages and combined rewards of every sample of `groups`, in order."""
    rollouts = [r for g in groups for r in g.rollouts]
    ids = [g.group_id for g in groups for _ in g.rollouts]
    return compute_advantages([r.rewards for r in rollouts], ids, cfg)


def is_zero_variance(rollouts: list[Rollout], cfg: AdvantageConfig) -> bool:
    """True when the group's rewards give no learning signal (all its advantages are 0)."""
    result = compute_advantages([r.rewards for r in rollouts], [0] * len(rollouts), cfg)
    return bool(result.degenerate[0])

"""The arithmetic of the staleness study (`staleness_study.py`), kept apart so it can be
tested against hand-computed cases: Student-t quantiles and 95% intervals, differences
paired by seed, the noise of a cell, and the number of seeds that resolves a difference.

The venv has no scipy, so the t quantile is computed here: the t density integrated with
Simpson's rule from 0 (the CDF is 1/2 there), inverted by bisection. Exact to ~1e-9 for
the degrees of freedom and levels a study uses.

Seeds needed to resolve a difference δ between two cells, two-sided level α (0.05) and
power 1 − β (0.8):

    unpaired (cells on different seeds, per-run sd σ):   n = 2 (t_{1−α/2,ν} + t_{1−β,ν})² σ² / δ²
    paired by seed (sd of the per-seed differences σ_d): n = (t_{1−α/2,ν} + t_{1−β,ν})² σ_d² / δ²

with ν = 2(n − 1) unpaired, n − 1 paired: solved by iteration from the normal
approximation (z quantiles in place of t) and rounded up. Imported by plain name:
`benchmarks/` is on `sys.path` when a script of it runs.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist


def t_density(x: float, df: float) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def _unnormalised(x: float, df: float) -> float:
    return math.exp(-(df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: float, intervals: int = 4000) -> float:
    """P(T ≤ x) for Student's t with `df` degrees of freedom (Simpson's rule from 0)."""
    if x == 0:
        return 0.5
    h = abs(x) / intervals
    total = _unnormalised(0.0, df) + _unnormalised(abs(x), df)
    for i in range(1, intervals):
        total += (4 if i % 2 else 2) * _unnormalised(i * h, df)
    half = t_density(0.0, df) * total * h / 3  # the density is density(0) × the unnormalised one
    return 0.5 + half if x > 0 else 0.5 - half


def t_quantile(p: float, df: float) -> float:
    """The x with P(T ≤ x) = p (bisection on `t_cdf`)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def interval(values: list[float], level: float = 0.95) -> dict:
    """n, mean, sd and the t interval of the mean (None bounds when n < 2)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "half_width": None, "low": None, "high": None}
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": 1, "mean": mean, "sd": None, "half_width": None, "low": None, "high": None}
    sd = statistics.stdev(values)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "half_width": half,
        "low": mean - half,
        "high": mean + half,
    }


def paired_difference(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> dict:
    """a − b over the seeds both have, with the t interval of its mean; `excludes_zero`
    says whether the difference is resolved at this level."""
    seeds = sorted(set(a) & set(b))
    out = interval([a[s] - b[s] for s in seeds], level)
    out["seeds"] = seeds
    low, high = out["low"], out["high"]
    out["excludes_zero"] = None if low is None else bool(low > 0 or high < 0)
    return out


def pooled_sd(groups: list[list[float]]) -> float | None:
    """sqrt(Σ (n_i − 1) s_i² / Σ (n_i − 1)) over the groups with at least two values."""
    usable = [g for g in groups if len(g) >= 2]
    dof = sum(len(g) - 1 for g in usable)
    if not dof:
        return None
    return math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in usable) / dof)


def repeat_sd(pairs: list[tuple[float, float]]) -> float | None:
    """Run-to-run sd from runs repeated with the same configuration and seed:
    sqrt(Σ (x − y)² / 2m) over m pairs (each difference has variance 2σ²)."""
    if not pairs:
        return None
    return math.sqrt(sum((x - y) ** 2 for x, y in pairs) / (2 * len(pairs)))


def seeds_needed(
    sd: float, delta: float, *, paired: bool = False, level: float = 0.95, power: float = 0.8
) -> int:
    """Seeds per cell that resolve a true difference `delta` (formula in the docstring)."""
    if delta <= 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    factor = 1.0 if paired else 2.0
    z = NormalDist().inv_cdf(1 - (1 - level) / 2) + NormalDist().inv_cdf(power)
    n = max(2, math.ceil(factor * z * z * sd * sd / (delta * delta)))
    for _ in range(50):
        df = (n - 1) if paired else 2 * (n - 1)
        t = t_quantile(1 - (1 - level) / 2, df) + t_quantile(power, df)
        new = max(2, math.ceil(factor * t * t * sd * sd / (delta * delta)))
        if new == n:
            break
        n = new
    return n

"""What the staleness study (`staleness_study.py`) reads from a finished run, and how it
reports a stage: per-run summaries, per-cell intervals, paired differences, the noise
measurement, the markdown table and the figure.

A run's summary comes from its `metrics.jsonl` (the trainer's rows, steps 1..N) and from
the held-out reward the study's one evaluator gave its final weights. The statistics are
in `staleness_stats.py`. Imported by plain name (`benchmarks/` is on `sys.path`).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from staleness_stats import interval, paired_difference, pooled_sd, repeat_sd, seeds_needed

MEANS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "masked_fraction",
    "m2_before",
    "m2_masked_fraction",
    "is_weight_mean",
    "is_weight_sq_mean",
    "mismatch_kl",
    "token_staleness_mean",
    "staleness_mean",
    "completion_len_mean",
    "train_step_s",
)
"""Per-step metrics a run summary averages over steps 1..N."""
PER_STEP = ("reward_mean", "mismatch_kl", "token_staleness_mean", "clip_ratio", "is_weight_mean")
"""Per-step metrics a run summary keeps as lists (for curves)."""


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if _finite(r.get(key))]
    return statistics.fmean(values) if values else None


def _mean_or_none(values: list) -> float | None:
    finite = [v for v in values if _finite(v)]
    return statistics.fmean(finite) if finite else None


def first_crossing(rewards: list[float | None], threshold: float, window: int) -> int | None:
    """The first step (1-based) whose trailing mean over `window` steps reaches `threshold`."""
    for end in range(window, len(rewards) + 1):
        recent = [r for r in rewards[end - window : end] if _finite(r)]
        if recent and statistics.fmean(recent) >= threshold:
            return end
    return None


def version_rewards(rows: list[dict], last_version: int) -> list[float | None]:
    """Training reward by the policy version that sampled it, versions 0..`last_version`.

    Step t's batch was sampled by version t − 1 − `staleness_mean` (the trainer holds
    version t − 1 when it takes the batch), so an asynchronous run's reward curve lags
    its policy by its staleness: at staleness 1, step t shows version t − 2. Each row goes
    to its nearest version; versions with several rows take their mean, versions with
    none the straight line between their neighbours (None past either end)."""
    bins: dict[int, list[float]] = {}
    for r in rows:
        if _finite(r.get("reward_mean")) and _finite(r.get("staleness_mean")):
            version = round(r["step"] - 1 - r["staleness_mean"])
            if 0 <= version <= last_version:
                bins.setdefault(version, []).append(r["reward_mean"])
    means = {v: statistics.fmean(values) for v, values in bins.items()}
    out: list[float | None] = []
    for v in range(last_version + 1):
        below = [u for u in means if u <= v]
        above = [u for u in means if u >= v]
        if not below or not above:
            out.append(None)
            continue
        lo, hi = max(below), min(above)
        share = 0.0 if hi == lo else (v - lo) / (hi - lo)
        out.append(means[lo] + share * (means[hi] - means[lo]))
    return out


def run_summary(train_rows: list[dict], steps: int, threshold: float, window: int = 3) -> dict:
    """The study's numbers for one run from its train rows of steps 1..`steps`.

    `area`: mean training reward (`reward_mean`) over those steps. `version_area`: mean
    training reward by sampling version over versions 0..N − 2, the versions a run at
    staleness 1 samples with (`version_rewards`): the reward of the policy after each
    number of updates, the per-step learning with the lag taken out. Time to the threshold:
    the first step whose trailing `window`-step mean reward reaches it, and its `time_s`.
    `mismatch_kl` is KL(π_engine‖π_θ) on the step's tokens: kernel mismatch alone at
    realised staleness 0; at staleness exactly 1 it adds the KL between consecutive
    policies (see the study's docstring).
    """
    rows = sorted((r for r in train_rows if r["step"] <= steps), key=lambda r: r["step"])
    rewards = [r.get("reward_mean") for r in rows]
    crossed = first_crossing(rewards, threshold, window)
    out = {
        "steps": len(rows),
        "area": _mean_of(rows, "reward_mean"),
        "version_area": _mean_or_none(version_rewards(rows, steps - 2)),
        "threshold": threshold,
        "threshold_step": crossed,
        "threshold_time_s": rows[crossed - 1].get("time_s") if crossed else None,
        "train_time_s": rows[-1].get("time_s") if rows else None,
        "is_weight_min": min(
            (r["is_weight_min"] for r in rows if _finite(r.get("is_weight_min"))), default=None
        ),
        "is_weight_max": max(
            (r["is_weight_max"] for r in rows if _finite(r.get("is_weight_max"))), default=None
        ),
        "token_staleness_max": max(
            (r["token_staleness_max"] for r in rows if _finite(r.get("token_staleness_max"))),
            default=None,
        ),
    }
    out.update({key: _mean_of(rows, key) for key in MEANS})
    out["per_step"] = {key: [r.get(key) for r in rows] for key in PER_STEP}
    return out


def band(curves: list[list[float | None]]) -> list[dict]:
    """Per step: the mean over runs and its 95% t interval."""
    length = max((len(c) for c in curves), default=0)
    return [interval([c[i] for c in curves if i < len(c) and _finite(c[i])]) for i in range(length)]


def cell_table(results: list[dict]) -> dict[str, dict]:
    """Per cell (first repeat of each seed): intervals of the area and of the final
    held-out reward, means of the diagnostics, the training-reward band."""
    cells: dict[str, list[dict]] = {}
    for r in results:
        if r["repeat"] == 0:
            cells.setdefault(r["cell"], []).append(r)
    table = {}
    for name, runs in sorted(cells.items()):
        runs.sort(key=lambda r: r["seed"])
        row = {
            "seeds": [r["seed"] for r in runs],
            "overrides": runs[0]["overrides"],
            **{
                key: interval([m(r) for r in runs if _finite(m(r))])
                for key, m in (("area", area_of), ("version_area", version_area_of))
            },
            "final_held_out": interval([r["held_out_final"] for r in runs]),
            "initial_held_out": statistics.fmean(r["held_out_initial"] for r in runs),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            "threshold_steps": [r["summary"]["threshold_step"] for r in runs],
            "reward_band": band([r["summary"]["per_step"]["reward_mean"] for r in runs]),
        }
        for key in (*MEANS, "is_weight_min", "is_weight_max", "token_staleness_max"):
            values = [r["summary"][key] for r in runs if _finite(r["summary"].get(key))]
            row[key] = statistics.fmean(values) if values else None
        table[name] = row
    return table


def area_of(run: dict) -> float | None:
    return run["summary"]["area"]


def version_area_of(run: dict) -> float | None:
    return run["summary"].get("version_area")


def final_of(run: dict) -> float | None:
    return run["held_out_final"]


METRICS = {"area": area_of, "version_area": version_area_of, "final_held_out": final_of}
"""The numbers the study compares cells on."""


def by_seed(results: list[dict], cell: str, metric) -> dict[int, float]:
    """`metric` of `cell`'s first repeat per seed."""
    chosen = (r for r in results if r["cell"] == cell and r["repeat"] == 0)
    return {r["seed"]: metric(r) for r in chosen if _finite(metric(r))}


def comparisons(results: list[dict], pairs: list[tuple[str, str]]) -> list[dict]:
    """Cell − reference, paired by seed, for the area and the final held-out reward."""
    return [
        {
            "cell": cell,
            "reference": reference,
            **{
                name: paired_difference(by_seed(results, cell, m), by_seed(results, reference, m))
                for name, m in METRICS.items()
            },
        }
        for cell, reference in pairs
    ]


def noise_report(results: list[dict], delta: float = 0.1) -> dict:
    """Run-to-run sd (same cell and seed, repeated), seed-to-seed sd (pooled over cells),
    and the seeds per cell that resolve `delta`, unpaired and (where paired differences
    exist) paired."""
    out: dict = {"delta": delta}
    first = {(r["cell"], r["seed"]): r for r in results if r["repeat"] == 0}
    for name, get in METRICS.items():
        pairs = [
            (get(first[(r["cell"], r["seed"])]), get(r))
            for r in results
            if r["repeat"] > 0 and (r["cell"], r["seed"]) in first
        ]
        pairs = [(a, b) for a, b in pairs if _finite(a) and _finite(b)]
        by_cell: dict[str, list[float]] = {}
        for (cell, _), r in first.items():
            if _finite(get(r)):
                by_cell.setdefault(cell, []).append(get(r))
        run_sd, seed_sd = repeat_sd(pairs), pooled_sd(list(by_cell.values()))
        out[name] = {
            "repeat_pairs": len(pairs),
            "run_sd": run_sd,
            "seed_sd": seed_sd,
            "seeds_needed_unpaired": seeds_needed(seed_sd, delta) if seed_sd else None,
        }
    return out


def add_paired_seeds_needed(noise: dict, diffs: list[dict]) -> None:
    """Seeds needed paired by seed, from the sd of the observed per-seed differences."""
    for key in METRICS:
        sds = [d[key]["sd"] for d in diffs if d[key].get("sd")]
        if sds and key in noise:
            sd = math.sqrt(statistics.fmean(s * s for s in sds))
            noise[key]["paired_diff_sd"] = sd
            noise[key]["seeds_needed_paired"] = seeds_needed(sd, noise["delta"], paired=True)


def _ci(stat: dict, spec: str = ".3f") -> str:
    if stat.get("mean") is None:
        return "-"
    if stat.get("half_width") is None:
        return f"{stat['mean']:{spec}} (n=1)"
    return f"{stat['mean']:{spec}} [{stat['low']:{spec}}, {stat['high']:{spec}}]"


def _num(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(stage: str, steps: int, table: dict, diffs: list[dict], noise: dict) -> str:
    """The stage's tables: cells, paired differences, noise."""
    lines = [
        f"### Staleness study, stage `{stage}`: {steps} steps per run",
        "",
        "Area: mean training reward over steps 1..N. By version: mean training reward by "
        "the policy version that sampled it, versions 0..N-2 (the lag taken out). Final: "
        "held-out reward at step N (greedy, one evaluator, scored after the runs). Means "
        "over seeds with 95% t intervals.",
        "",
        "| cell | n | area | by version | final held-out | clip | masked | M2 / M2-masked "
        "| IS w min/mean/max | mismatch KL | token staleness mean/max | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        weights = "/".join(
            _num(row[k], ".2f") for k in ("is_weight_min", "is_weight_mean", "is_weight_max")
        )
        lines.append(
            f"| {name} | {row['area']['n']} | {_ci(row['area'])} | {_ci(row['version_area'])} "
            f"| {_ci(row['final_held_out'])} "
            f"| {_num(row['clip_ratio'])} | {_num(row['masked_fraction'])} "
            f"| {_num(row.get('m2_before'))}/{_num(row.get('m2_masked_fraction'))} | {weights} "
            f"| {_num(row['mismatch_kl'], '.4f')} | {_num(row['token_staleness_mean'], '.2f')}"
            f"/{_num(row['token_staleness_max'], '.0f')} | {_num(row['wall_s'], '.0f')} |"
        )
    if diffs:
        lines += [
            "",
            "| cell − reference (paired by seed) | seeds | area | by version | final held-out |",
            "|---|---|---|---|---|",
        ]
        for d in diffs:
            lines.append(
                f"| {d['cell']} − {d['reference']} | {len(d['area']['seeds'])} "
                f"| {_ci(d['area'], '+.3f')} | {_ci(d['version_area'], '+.3f')} "
                f"| {_ci(d['final_held_out'], '+.3f')} |"
            )
    lines += [
        "",
        f"Noise (δ = {noise['delta']}): seeds per cell to resolve δ at 95%, power 0.8",
        "",
    ]
    lines += [
        "| metric | repeat pairs | run-to-run sd | seed-to-seed sd | seeds (unpaired) | seeds (paired) |"
    ]
    lines += ["|---|---|---|---|---|---|"]
    for key in METRICS:
        n = noise.get(key, {})
        lines.append(
            f"| {key} | {n.get('repeat_pairs', 0)} | {_num(n.get('run_sd'))} | {_num(n.get('seed_sd'))} "
            f"| {_num(n.get('seeds_needed_unpaired'), 'd')} | {_num(n.get('seeds_needed_paired'), 'd')} |"
        )
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path, title: str) -> Path:
    """Training reward vs step with a 95% band per cell; final held-out per cell with its
    interval. matplotlib is imported here, not at module load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, finals) = plt.subplots(
        1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]}
    )
    means, finals_seen = [], []
    for i, (name, row) in enumerate(table.items()):
        points = [(s + 1, b) for s, b in enumerate(row["reward_band"]) if b["mean"] is not None]
        means += [b["mean"] for _, b in points]
        steps = [s for s, _ in points]
        (line,) = curves.plot(steps, [b["mean"] for _, b in points], label=name, lw=1.2)
        low = [b["low"] if b["low"] is not None else b["mean"] for _, b in points]
        high = [b["high"] if b["high"] is not None else b["mean"] for _, b in points]
        curves.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
        final = row["final_held_out"]
        if final["mean"] is not None:
            err = final["half_width"] or 0.0
            finals.errorbar([final["mean"]], [i], xerr=[err], fmt="o", color=line.get_color())
            finals_seen.append(final["mean"])
    # the axes follow the means: a few seeds' t intervals can be wider than the reward range
    if means:
        curves.set_ylim(min(means) - 0.15, max(means) + 0.15)
    if finals_seen:
        finals.set_xlim(min(finals_seen) - 0.3, max(finals_seen) + 0.3)
    curves.set(xlabel="step", ylabel="training reward (mean of the batch)", title=title)
    curves.legend(fontsize=7)
    finals.set_yticks(range(len(table)), list(table), fontsize=7)
    finals.set(xlabel="held-out reward at the last step (95% interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

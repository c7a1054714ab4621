"""PNG plots drawn from a run directory's files alone (`asyncgrpo plot RUN_DIR`).

`plot_run` writes to `RUN_DIR/plots/`:
- `reward.png`: train reward (sampled) mean ± std and held-out reward (greedy, or
  sampled for agent episodes), vs step and vs wall-clock;
- `staleness.png`: histogram of trained groups by staleness (summed `staleness_counts`),
  with the groups dropped as too stale as `accounting.json` counts them;
- `timeline.png`: engine-busy vs trainer-busy (and weight-sync) intervals — the overlap;
- `pipeline.png`: throughput, overlap ratios, staleness (mean and max) and the buffer's
  queued / in-flight groups per step, each panel on its own labelled axis.

`reward_figure`, `staleness_figure` and `pipeline_figure` return the figures unsaved.

Several runs on one figure, and the `asyncgrpo plot` command: `compare.py`.

Uses matplotlib's object API (`Figure`, Agg canvas) rather than pyplot: no global
backend switch, safe from threads, nothing ever opens a window. matplotlib is
imported on first use, so importing asyncgrpo does not pay for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .timeline import ENGINE, TRAINER, WEIGHT_SYNC, busy_ratio, read_timeline
from .tracker import TIMELINE_FILE, read_metrics

ACCOUNTING_FILE = "accounting.json"
ROLE_COLORS = {ENGINE: "tab:blue", TRAINER: "tab:orange", WEIGHT_SYNC: "tab:red"}


def _figure(ncols: int = 1, nrows: int = 1, size=(7.0, 4.0)):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=110, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    return fig, list(axes)


def _col(rows: Sequence[Mapping], key: str) -> list[float]:
    out = []
    for r in rows:
        v = r.get(key)
        out.append(
            float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        )
    return out


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} yet", ha="center", va="center", transform=ax.transAxes)


def _time_axis(seconds: list[float]) -> tuple[list[float], str]:
    finite = [s for s in seconds if math.isfinite(s)]
    if finite and max(finite) > 300:
        return [s / 60 for s in seconds], "wall-clock (min)"
    return seconds, "wall-clock (s)"


def _decoding(evals) -> str:
    """How the held-out rows were sampled; lines written before `eval_decoding` existed
    are greedy unless they come from agent episodes (which carry `eval_untrainable`)."""
    for row in evals:
        if isinstance(row.get("eval_decoding"), str):
            return row["eval_decoding"]
    return "sampled" if any("eval_untrainable" in row for row in evals) else "greedy"


def _reward_panel(ax, train, evals, x_key: str) -> None:
    if not train and not evals:
        _no_data(ax, "reward")
        return
    xs = _col(train, x_key)
    if x_key == "time_s":
        xs, xlabel = _time_axis(xs)
        ex, _ = _time_axis(_col(evals, x_key))
    else:
        xlabel, ex = "optimizer step", _col(evals, x_key)
    mean, std = _col(train, "reward_mean"), _col(train, "reward_std")
    if train:
        ax.plot(xs, mean, color="tab:blue", lw=1.5, label="train, sampled: mean")
        lo = [m - (s if math.isfinite(s) else 0) for m, s in zip(mean, std)]
        hi = [m + (s if math.isfinite(s) else 0) for m, s in zip(mean, std)]
        ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15, lw=0, label="train: ± 1 std")
    if evals:
        ys = _col(evals, "eval_reward_mean")
        label = f"held-out, {_decoding(evals)}: mean"
        ax.plot(ex, ys, "o-", color="tab:green", ms=5, lw=1, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def reward_figure(train, evals):
    fig, (by_step, by_time) = _figure(ncols=2, size=(11.0, 4.0))
    _reward_panel(by_step, train, evals, "step")
    _reward_panel(by_time, train, evals, "time_s")
    by_step.set_title("reward vs step")
    by_time.set_title("reward vs wall-clock")
    return fig


def plot_reward(train, evals, out: Path) -> Path:
    reward_figure(train, evals).savefig(out)
    return out


def read_accounting(run_dir: Path) -> dict | None:
    """`accounting.json` (where every admitted group went), or None if absent or unreadable."""
    try:
        return json.loads((run_dir / ACCOUNTING_FILE).read_text())
    except (OSError, ValueError):
        return None


def dropped_stale(train, accounting: Mapping | None) -> int:
    """Groups dropped as too stale: accounting.json's count, else the last row's (both are
    run totals, so rows are not summed)."""
    if accounting is not None:
        return int((accounting.get("dropped") or {}).get("stale", 0))
    counts = [v for v in _col(train, "dropped_stale") if math.isfinite(v)]
    return int(counts[-1]) if counts else 0


def staleness_figure(train, accounting: Mapping | None = None):
    counts: dict[int, int] = {}
    for row in train:
        for k, n in (row.get("staleness_counts") or {}).items():
            if isinstance(n, (int, float)):
                counts[int(k)] = counts.get(int(k), 0) + int(n)
    fig, (ax,) = _figure(size=(6.0, 4.0))
    stale = dropped_stale(train, accounting)
    other = sum((accounting or {}).get("dropped", {}).values()) - stale if accounting else 0
    dropped = f"dropped as too stale: {stale}" + (f" (other drops: {other})" if other else "")
    if counts:
        keys = list(range(min(counts), max(counts) + 1))
        ax.bar(keys, [counts.get(k, 0) for k in keys], color="tab:purple", width=0.8)
        ax.set_xticks(keys)
        total = max(sum(counts.values()), 1)
        mean = sum(k * n for k, n in counts.items()) / total
        ax.set_title(
            f"staleness of trained groups\n{total} trained, mean {mean:.2f}; {dropped}",
            fontsize=10,
        )
    else:
        _no_data(ax, "staleness_counts")
        ax.set_title(f"staleness of trained groups\n{dropped}", fontsize=10)
    ax.set_xlabel("staleness (policy versions behind)")
    ax.set_ylabel("groups")
    ax.grid(alpha=0.3, axis="y")
    return fig


def plot_staleness(train, out: Path, accounting: Mapping | None = None) -> Path:
    staleness_figure(train, accounting).savefig(out)
    return out


def plot_timeline(intervals, out: Path) -> Path:
    roles = [r for r in ROLE_COLORS if any(i.role == r for i in intervals)]
    roles += sorted({i.role for i in intervals} - set(roles))
    fig, (ax,) = _figure(size=(11.0, 1.2 + 0.6 * max(len(roles), 1)))
    if not intervals:
        _no_data(ax, "timeline")
    else:
        t0 = min(i.start_s for i in intervals)
        t1 = max(i.end_s for i in intervals)
        labels = []
        for row, role in enumerate(roles):
            spans = [(i.start_s, i.end_s - i.start_s) for i in intervals if i.role == role]
            ax.broken_barh(spans, (row - 0.4, 0.8), color=ROLE_COLORS.get(role, "tab:gray"), lw=0)
            labels.append(f"{role}\n{busy_ratio(intervals, role, t0, t1):.0%} busy")
        ax.set_yticks(range(len(roles)), labels, fontsize=8)
        ax.set_ylim(-0.6, len(roles) - 0.4)
        ax.set_xlim(t0, t1)
        ax.invert_yaxis()
    ax.set_xlabel("run time (s)")
    ax.set_title("pipeline timeline: when each role was busy")
    ax.grid(alpha=0.3, axis="x")
    fig.savefig(out)
    return out


# (title, y-axis label, [(metric key, legend name, line style)]) per pipeline panel
PIPELINE_PANELS = [
    (
        "throughput",
        "tokens / s",
        [
            ("gen_tokens_per_s", "generated (engine)", "-"),
            ("train_tokens_per_s", "trained (trainer)", "-"),
        ],
    ),
    (
        "overlap",
        "fraction of the step's time",
        [
            ("engine_busy_ratio", "engine busy", "-"),
            ("trainer_idle_ratio", "trainer idle (waiting for a batch)", "-"),
        ],
    ),
    (
        "staleness of the trained groups",
        "policy versions behind",
        # max as markers only, on top: it often equals the mean and would hide under a line
        [("staleness_mean", "mean", "-"), ("staleness_max", "max", "v")],
    ),
    (
        "rollout buffer",
        "groups",
        [
            ("queue_size", "queued (ready to train)", "-"),
            ("in_flight", "in flight (being generated)", "--"),
        ],
    ),
]


def pipeline_figure(train):
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(ncols=2, nrows=2, size=(11.0, 6.5))
    steps = _col(train, "step")
    for ax, (title, ylabel, lines) in zip(axes, PIPELINE_PANELS):
        drawn = False
        for key, name, style in lines:
            ys = _col(train, key)
            if any(math.isfinite(y) for y in ys):
                ax.plot(steps, ys, style, lw=1.5, ms=5, label=name)
                drawn = True
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            _no_data(ax, title)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_ylim(-0.02, 1.02)  # a ratio
    for ax in axes[2:]:  # versions and groups are whole numbers
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def plot_pipeline(train, out: Path) -> Path:
    pipeline_figure(train).savefig(out)
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Regenerate every plot of `run_dir` from its files; returns the PNG paths."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    train, evals = read_metrics(run_dir)
    intervals = read_timeline(run_dir / TIMELINE_FILE)
    return [
        plot_reward(train, evals, out_dir / "reward.png"),
        plot_staleness(train, out_dir / "staleness.png", read_accounting(run_dir)),
        plot_timeline(intervals, out_dir / "timeline.png"),
        plot_pipeline(train, out_dir / "pipeline.png"),
    ]

"""PNG plots drawn from a run directory's files alone (`asyncgrpo plot RUN_DIR`).

`plot_run` writes to `RUN_DIR/plots/`:
- `reward.png`: train reward mean ± std and held-out eval reward, vs step and vs wall-clock;
- `staleness.png`: histogram of consumed samples by staleness (summed `staleness_counts`);
- `timeline.png`: engine-busy vs trainer-busy (and weight-sync) intervals — the overlap;
- `pipeline.png`: throughput, overlap ratios, staleness and queue depth per step.

`plot_compare` draws held-out reward vs wall-clock for several runs (the benchmark figure).

Uses matplotlib's object API (`Figure`, Agg canvas) rather than pyplot: no global
backend switch, safe from threads, nothing ever opens a window. matplotlib is
imported on first use, so importing asyncgrpo does not pay for it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .timeline import ENGINE, TRAINER, WEIGHT_SYNC, busy_ratio, read_timeline
from .tracker import TIMELINE_FILE, read_metrics

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
        ax.plot(xs, mean, color="tab:blue", lw=1.5, label="train reward (mean)")
        lo = [m - (s if math.isfinite(s) else 0) for m, s in zip(mean, std)]
        hi = [m + (s if math.isfinite(s) else 0) for m, s in zip(mean, std)]
        ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15, lw=0, label="± std")
    if evals:
        ax.plot(
            ex,
            _col(evals, "eval_reward_mean"),
            "o-",
            color="tab:green",
            ms=5,
            lw=1,
            label="held-out reward",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot_reward(train, evals, out: Path) -> Path:
    fig, (by_step, by_time) = _figure(ncols=2, size=(11.0, 4.0))
    _reward_panel(by_step, train, evals, "step")
    _reward_panel(by_time, train, evals, "time_s")
    by_step.set_title("reward vs step")
    by_time.set_title("reward vs wall-clock")
    fig.savefig(out)
    return out


def plot_staleness(train, out: Path) -> Path:
    counts: dict[int, int] = {}
    for row in train:
        for k, n in (row.get("staleness_counts") or {}).items():
            if isinstance(n, (int, float)):
                counts[int(k)] = counts.get(int(k), 0) + int(n)
    fig, (ax,) = _figure(size=(6.0, 4.0))
    dropped = sum(v for v in _col(train, "dropped_stale") if math.isfinite(v))
    if counts:
        keys = list(range(min(counts), max(counts) + 1))
        ax.bar(keys, [counts.get(k, 0) for k in keys], color="tab:purple", width=0.8)
        ax.set_xticks(keys)
        mean = sum(k * n for k, n in counts.items()) / max(sum(counts.values()), 1)
        ax.set_title(f"staleness of consumed samples (mean {mean:.2f}, dropped {dropped:.0f})")
    else:
        _no_data(ax, "staleness_counts")
        ax.set_title("staleness of consumed samples")
    ax.set_xlabel("staleness (policy versions behind)")
    ax.set_ylabel("samples")
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(out)
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


def plot_pipeline(train, out: Path) -> Path:
    fig, axes = _figure(ncols=3, size=(13.0, 3.6))
    steps = _col(train, "step")
    panels = [
        ("throughput (tok/s)", ["gen_tokens_per_s", "train_tokens_per_s"]),
        ("overlap", ["engine_busy_ratio", "trainer_idle_ratio"]),
        ("staleness / queue", ["staleness_mean", "staleness_max", "queue_size"]),
    ]
    for ax, (title, keys) in zip(axes, panels):
        drawn = False
        for key in keys:
            ys = _col(train, key)
            if any(math.isfinite(y) for y in ys):
                ax.plot(steps, ys, lw=1.3, label=key)
                drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            _no_data(ax, title)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.savefig(out)
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
        plot_staleness(train, out_dir / "staleness.png"),
        plot_timeline(intervals, out_dir / "timeline.png"),
        plot_pipeline(train, out_dir / "pipeline.png"),
    ]


def plot_compare(
    run_dirs: Mapping[str, str | Path], out_png: str | Path, title: str = "held-out reward"
) -> Path:
    """Held-out reward vs wall-clock for several runs (train reward, dashed, if a run has no eval)."""
    curves = {}
    for label, path in run_dirs.items():
        train, evals = read_metrics(path)
        rows, key = (evals, "eval_reward_mean") if evals else (train, "reward_mean")
        suffix = "" if evals or not rows else " (train reward)"
        curves[label + suffix] = list(zip(_col(rows, "time_s"), _col(rows, key), strict=True))
    return plot_curves(curves, out_png, title)


def plot_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    out_png: str | Path,
    title: str = "held-out reward",
) -> Path:
    """Reward vs wall-clock, one line per label ("(train reward)" labels are dashed)."""
    fig, (ax,) = _figure(size=(7.5, 4.5))
    minutes = _time_axis([t for points in curves.values() for t, _ in points])[1].endswith("(min)")
    scale = 60.0 if minutes else 1.0
    for label, points in curves.items():
        if points:
            style = "--" if label.endswith("(train reward)") else "o-"
            xs, ys = zip(*points, strict=True)
            ax.plot([t / scale for t in xs], ys, style, ms=4, lw=1.4, label=label)
    if not any(curves.values()):
        _no_data(ax, "metrics")
    ax.set_xlabel("wall-clock (min)" if minutes else "wall-clock (s)")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


def plot_main(argv: Sequence[str] | None = None) -> int:
    """`asyncgrpo plot RUN_DIR...` and `asyncgrpo plot --compare OUT.png [LABEL=]RUN_DIR...`."""
    parser = argparse.ArgumentParser(
        prog="asyncgrpo plot", description="Draw PNG plots from run directories."
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories ([LABEL=]DIR with --compare)")
    parser.add_argument("--compare", metavar="OUT.png", help="one held-out reward plot of all runs")
    parser.add_argument("--out-dir", help="where plot_run writes (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    runs: list[tuple[str, str]] = []
    for spec in args.run_dirs:
        label, sep, path = spec.partition("=")
        if not (sep and args.compare):
            label, path = Path(spec).name, spec
        if not (Path(path) / "metrics.jsonl").exists():
            parser.error(f"{path}: no metrics.jsonl (is it a run directory?)")
        runs.append((label, path))
    if args.compare:
        print(plot_compare(dict(runs), args.compare))
        return 0
    for label, path in runs:
        out_dir = args.out_dir and (Path(args.out_dir) / label if len(runs) > 1 else args.out_dir)
        for png in plot_run(path, out_dir):
            print(png)
    return 0

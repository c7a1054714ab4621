"""Several runs on one figure (`plot_compare`, the benchmarks' figure) and the
`asyncgrpo plot` command (`plot_main`), on top of the single-run plots of `plots.py`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path

from .plots import _col, _figure, _no_data, _time_axis, plot_run
from .tracker import read_metrics


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

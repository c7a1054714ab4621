"""Run-directory metrics: JSONL record, optional mirrors, timeline, progress line, plots.

`MetricsTracker` owns `runs/<name>/{metrics,samples,timeline}.jsonl`; plots are
regenerated from those files alone (`asyncgrpo plot RUN_DIR` -> `plot_main`).
`plots` is not imported here so that importing asyncgrpo never loads matplotlib.
"""

from .progress import ProgressDisplay
from .sinks import JsonlWriter, iter_jsonl, make_sinks, to_jsonable
from .timeline import (
    ENGINE,
    TRAINER,
    WEIGHT_SYNC,
    Interval,
    Timeline,
    busy_ratio,
    engine_busy_ratio,
    merge_intervals,
    read_timeline,
    trainer_idle_ratio,
)
from .tracker import MetricsTracker, aggregate_metrics, count_values, read_metrics


def plot_run(run_dir, out_dir=None):
    """Lazy forwarder to `asyncgrpo.learning.metrics.plots.plot_run` (imports matplotlib)."""
    from .plots import plot_run as _plot_run

    return _plot_run(run_dir, out_dir)


def plot_compare(run_dirs, out_png, title="held-out reward"):
    """Lazy forwarder to `asyncgrpo.learning.metrics.compare.plot_compare` (imports matplotlib)."""
    from .compare import plot_compare as _plot_compare

    return _plot_compare(run_dirs, out_png, title)


def plot_main(argv=None) -> int:
    """Lazy forwarder to `asyncgrpo.learning.metrics.compare.plot_main` (`asyncgrpo plot`)."""
    from .compare import plot_main as _plot_main

    return _plot_main(argv)


__all__ = [
    "ENGINE",
    "TRAINER",
    "WEIGHT_SYNC",
    "Interval",
    "JsonlWriter",
    "MetricsTracker",
    "ProgressDisplay",
    "Timeline",
    "aggregate_metrics",
    "busy_ratio",
    "count_values",
    "engine_busy_ratio",
    "iter_jsonl",
    "make_sinks",
    "merge_intervals",
    "plot_compare",
    "plot_main",
    "plot_run",
    "read_metrics",
    "read_timeline",
    "to_jsonable",
    "trainer_idle_ratio",
]

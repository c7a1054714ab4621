"""Plots are drawn from a run directory's files alone and are valid, non-empty PNGs."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from asyncgrpo.learning.metrics import MetricsTracker, count_values  # noqa: E402
from asyncgrpo.learning.metrics.compare import plot_compare, plot_main  # noqa: E402
from asyncgrpo.learning.metrics.plots import plot_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000, path


def make_run(run_dir, steps=30, speed=1.0, seed=0):
    """A synthetic run: rising reward, staleness ≤ 2, alternating engine/trainer work."""
    rng = random.Random(seed)
    with MetricsTracker(run_dir) as tracker:
        t = 0.0
        for step in range(1, steps + 1):
            tl = tracker.timeline
            tl.record("engine", t, t + 3.0 / speed)
            tl.record("trainer", t + 1.0 / speed, t + 2.8 / speed)
            tl.record("weight_sync", t + 2.8 / speed, t + 3.0 / speed)
            t += 3.0 / speed
            stale = [rng.choice([0, 1, 1, 2]) for _ in range(16)]
            reward = 0.2 + 0.6 * step / steps + rng.uniform(-0.05, 0.05)
            tracker.log_step(
                step,
                {
                    "time_s": t,
                    "version": step,
                    "reward_mean": reward,
                    "reward_std": 0.2,
                    "staleness_mean": sum(stale) / 16,
                    "staleness_max": max(stale),
                    "staleness_counts": count_values(stale),
                    "dropped_stale": int(step % 3 == 0),
                    "queue_size": rng.randint(0, 4),
                    "gen_tokens_per_s": 200 + step,
                    "train_tokens_per_s": 140.0,
                    "engine_busy_ratio": 1.0,
                    "trainer_idle_ratio": 0.4,
                    "loss": math.nan,
                },
            )
            if step % 10 == 0 or step == 1:
                tracker.log_eval(step, {"time_s": t, "eval_reward_mean": reward - 0.05})


def test_plot_run_writes_valid_pngs(tmp_path):
    make_run(tmp_path / "run")
    paths = plot_run(tmp_path / "run")
    assert [p.name for p in paths] == [
        "reward.png",
        "staleness.png",
        "timeline.png",
        "pipeline.png",
    ]
    for path in paths:
        assert path.parent == tmp_path / "run" / "plots"
        _assert_png(path)


def test_cli_regenerates_plots_even_for_an_empty_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")  # a run killed before step 1
    assert plot_main([str(tmp_path / "empty"), "--out-dir", str(tmp_path / "regen")]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 4 and all(p.startswith(str(tmp_path / "regen")) for p in printed)
    for path in printed:
        _assert_png(Path(path))
    with pytest.raises(SystemExit):
        plot_main([str(tmp_path / "missing")])


def test_plot_compare_api_and_cli(tmp_path):
    make_run(tmp_path / "async", speed=2.0)
    make_run(tmp_path / "sync", speed=1.0, seed=1)
    out = plot_compare({"async": tmp_path / "async", "sync": tmp_path / "sync"}, tmp_path / "c.png")
    _assert_png(out)
    cmp_png = tmp_path / "cli.png"
    argv = ["--compare", str(cmp_png), f"a={tmp_path / 'async'}", str(tmp_path / "sync")]
    assert plot_main(argv) == 0
    _assert_png(cmp_png)

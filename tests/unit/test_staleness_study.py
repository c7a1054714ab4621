"""The staleness study's arithmetic (`benchmarks/staleness_stats.py`, `staleness_report.py`)
against hand-computed cases and published t-table values."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def stats(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name
    return importlib.import_module("staleness_stats")


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("staleness_report")


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 5, 2.571),
        (0.975, 10, 2.228),
        (0.975, 30, 2.042),
        (0.80, 5, 0.920),
        (0.80, 30, 0.854),
        (0.025, 5, -2.571),
    ],
)
def test_t_quantile_matches_the_printed_table(stats, p, df, table):
    assert stats.t_quantile(p, df) == pytest.approx(table, abs=1e-3)


def test_interval_of_one_two_three(stats):
    # mean 2, sd 1, half width t(0.975, 2) · 1/√3 = 4.3027 / 1.7321 = 2.4841
    out = stats.interval([1.0, 2.0, 3.0])
    assert out["n"] == 3 and out["mean"] == 2.0 and out["sd"] == pytest.approx(1.0)
    assert out["half_width"] == pytest.approx(2.4841, abs=1e-4)
    assert (out["low"], out["high"]) == pytest.approx((-0.4841, 4.4841), abs=1e-4)


def test_interval_of_one_run_has_no_bounds(stats):
    out = stats.interval([0.7])
    assert out["n"] == 1 and out["mean"] == 0.7 and out["low"] is None and out["half_width"] is None


def test_paired_difference_uses_the_shared_seeds_only(stats):
    a = {0: 0.5, 1: 0.7, 2: 0.9}
    b = {0: 0.4, 1: 0.5, 2: 0.6, 3: 1.0}  # seed 3 has no partner
    out = stats.paired_difference(a, b)
    # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half width 4.3027 · 0.1 / √3 = 0.2484
    assert out["seeds"] == [0, 1, 2] and out["n"] == 3
    assert out["mean"] == pytest.approx(0.2) and out["sd"] == pytest.approx(0.1)
    assert out["half_width"] == pytest.approx(0.2484, abs=1e-4)
    assert out["excludes_zero"] is False  # [-0.048, 0.448]
    wide_apart = stats.paired_difference({0: 1.0, 1: 1.1, 2: 1.0}, {0: 0.0, 1: 0.0, 2: 0.1})
    assert wide_apart["excludes_zero"] is True


def test_noise_estimates(stats):
    # same config and seed twice: differences 0.1 and 0 -> σ² = (0.01 + 0) / (2 · 2)
    assert stats.repeat_sd([(0.5, 0.6), (0.7, 0.7)]) == pytest.approx(0.05)
    assert stats.repeat_sd([]) is None
    # variances 1 (dof 2) and 2 (dof 1), a single value ignored: (2·1 + 1·2) / 3 = 4/3
    assert stats.pooled_sd([[1.0, 2.0, 3.0], [5.0, 7.0], [4.0]]) == pytest.approx(math.sqrt(4 / 3))
    assert stats.pooled_sd([[4.0]]) is None


def test_seeds_needed_to_resolve_a_difference(stats):
    # unpaired, σ = δ: n = 2 (t(.975, 2n-2) + t(.8, 2n-2))²; at n = 17 (df 32, table
    # 2.0369 + 0.8530 = 2.8899): 2 · 8.3515 = 16.70 -> 17, a fixed point
    assert stats.seeds_needed(0.1, 0.1) == 17
    # paired, σ_d = δ: n = (t(.975, n-1) + t(.8, n-1))²; at n = 10 (df 9, 2.2622 + 0.8834
    # = 3.1456): 9.895 -> 10
    assert stats.seeds_needed(0.1, 0.1, paired=True) == 10
    # tiny noise still needs two runs for an interval
    assert stats.seeds_needed(0.001, 0.1) == 2
    with pytest.raises(ValueError, match="delta"):
        stats.seeds_needed(0.1, 0.0)


def test_run_summary_from_metric_rows(report):
    rows = [
        {"step": s, "time_s": 10.0 * s, "reward_mean": r, "is_weight_min": w0,
         "is_weight_max": w1, "is_weight_mean": 1.0, "token_staleness_mean": 1.0,
         "token_staleness_max": 1, "clip_ratio": c, "mismatch_kl": 0.01}
        for s, r, w0, w1, c in [
            (1, 0.2, 0.9, 1.5, 0.0), (2, 0.4, 0.5, 2.0, 0.1), (3, 0.6, 0.8, 1.2, 0.2),
            (4, 0.8, 0.1, 9.0, 0.3),  # beyond N = 3: ignored
        ]
    ]  # fmt: skip
    out = report.run_summary(rows, steps=3, threshold=0.4, window=2)
    assert out["steps"] == 3 and out["area"] == pytest.approx(0.4)  # (0.2 + 0.4 + 0.6) / 3
    # trailing 2-step means: step 2 -> 0.3, step 3 -> 0.5 >= 0.4
    assert out["threshold_step"] == 3 and out["threshold_time_s"] == 30.0
    assert (out["is_weight_min"], out["is_weight_max"]) == (0.5, 2.0)
    assert out["clip_ratio"] == pytest.approx(0.1) and out["token_staleness_max"] == 1
    assert out["per_step"]["reward_mean"] == [0.2, 0.4, 0.6]
    assert report.run_summary(rows, steps=3, threshold=0.9)["threshold_step"] is None


def test_noise_report_and_cell_table(report):
    def result(cell, seed, repeat, area, final):
        summary = {"area": area, "threshold_step": None, "per_step": {"reward_mean": [area]}}
        return {"cell": cell, "seed": seed, "repeat": repeat, "overrides": [], "wall_s": 1.0,
                "summary": summary, "held_out_initial": 0.2, "held_out_final": final}  # fmt: skip

    results = [
        result("a", 0, 0, 0.5, 0.6), result("a", 0, 1, 0.6, 0.6),
        result("a", 1, 0, 0.7, 0.8), result("b", 0, 0, 0.4, 0.5), result("b", 1, 0, 0.5, 0.9),
    ]  # fmt: skip
    noise = report.noise_report(results, delta=0.1)
    assert noise["area"]["repeat_pairs"] == 1
    assert noise["area"]["run_sd"] == pytest.approx(0.1 / math.sqrt(2))
    # a: 0.5, 0.7 (var 0.02); b: 0.4, 0.5 (var 0.005); pooled sqrt(0.0125)
    assert noise["area"]["seed_sd"] == pytest.approx(math.sqrt(0.0125))
    table = report.cell_table(results)
    assert table["a"]["seeds"] == [0, 1] and table["a"]["area"]["mean"] == pytest.approx(0.6)
    (diff,) = report.comparisons(results, [("a", "b")])
    assert diff["area"]["mean"] == pytest.approx(0.15)  # (0.1 + 0.2) / 2
    assert diff["final_held_out"]["mean"] == pytest.approx(0.0)  # 0.6 - 0.5, 0.8 - 0.9


def test_version_rewards_take_the_lag_out(report):
    """A run at staleness 1 (steps 2.. sampled two versions back) whose policy after v
    updates earns 0.1·v gives the same per-version curve as a synchronous one."""
    sync = [{"step": t, "reward_mean": 0.1 * (t - 1), "staleness_mean": 0.0} for t in range(1, 7)]
    lagged = [{"step": 1, "reward_mean": 0.0, "staleness_mean": 0.0}] + [
        {"step": t, "reward_mean": 0.1 * (t - 2), "staleness_mean": 1.0} for t in range(2, 7)
    ]
    by_version = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert report.version_rewards(sync, 4) == pytest.approx(by_version)
    assert report.version_rewards(lagged, 4) == pytest.approx(by_version)
    # the per-step area charges the lag; the version area does not
    assert report.run_summary(lagged, 6, 1.0)["area"] < report.run_summary(sync, 6, 1.0)["area"]
    assert report.run_summary(lagged, 6, 1.0)["version_area"] == pytest.approx(0.2)


def test_version_rewards_interpolate_a_gap_and_stop_at_the_ends(report):
    rows = [
        {"step": 1, "reward_mean": 0.2, "staleness_mean": 0.0},  # version 0
        {"step": 4, "reward_mean": 0.8, "staleness_mean": 0.0},  # version 3
    ]
    assert report.version_rewards(rows, 4) == pytest.approx([0.2, 0.4, 0.6, 0.8, None])


def test_a_fix_stage_pairs_each_staleness_with_sync_and_its_unfixed_cell(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    study = importlib.import_module("staleness_study")
    args = study.build_parser().parse_args(["--stage", "fix:m2", "--staleness", "0,1,4,16"])
    cells = {c.name: c for c in study.stage_cells("fix:m2", args)}
    sync = "recipe-st0-truncated_is-lr3e-05"
    assert set(cells) == {
        sync,
        *(f"recipe-st{k}-truncated_is-lr3e-05" for k in (1, 4, 16)),
        *(f"recipe-st{k}-truncated_is-lr3e-05-m2" for k in (1, 4, 16)),
    }
    far = cells["recipe-st16-truncated_is-lr3e-05-m2"]
    assert far.staleness == 16 and "loss.trust_region=m2" in far.overrides
    assert "coordinator.max_staleness=16" not in far.overrides  # the run sets it from the cell
    assert far.compare_to == [sync, "recipe-st16-truncated_is-lr3e-05"]
    assert cells["recipe-st4-truncated_is-lr3e-05"].compare_to == [sync]
    assert study.FIXES["masked-is"] == ["loss.correction=masked_is"]

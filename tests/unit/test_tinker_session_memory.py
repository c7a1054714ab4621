"""The session-memory benchmark (`benchmarks/tinker_session_memory.py`): its growth figure
against a hand-computed least-squares fit, and, as a `heavy` test, three abandoned
sessions against a real `tinker-serve` with the real SDK, which must come back with a
figure for the server and its engine."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("ASYNCGRPO_RESULTS_DIR", str(tmp_path / "results"))
    return importlib.import_module("tinker_session_memory")


def test_growth_per_session_is_the_least_squares_slope_with_its_interval(bench):
    values = [10.0, 10.5, 10.7, 11.6, 11.9, 12.4]
    n = len(values)
    xbar, ybar = (n - 1) / 2, sum(values) / n
    sxx = sum((x - xbar) ** 2 for x in range(n))
    b = sum((x - xbar) * (y - ybar) for x, y in enumerate(values)) / sxx
    a = ybar - b * xbar
    rss = sum((y - a - b * x) ** 2 for x, y in enumerate(values))
    half = 2.776 * math.sqrt(rss / (n - 2) / sxx)  # Student t, 4 degrees of freedom
    fit = bench.slope(values)
    assert fit["n"] == n
    assert fit["mib_per_session"] == pytest.approx(b)
    assert fit["low"] == pytest.approx(b - half, rel=1e-3)
    assert fit["high"] == pytest.approx(b + half, rel=1e-3)


def test_two_points_give_a_slope_without_an_interval(bench):
    fit = bench.slope([400.0, 401.0])
    assert fit["mib_per_session"] == pytest.approx(1.0) and fit["low"] is None


def test_a_flat_series_grows_by_nothing(bench):
    fit = bench.slope([400.0] * 12)
    assert fit["mib_per_session"] == pytest.approx(0.0, abs=1e-12)
    assert fit["low"] == pytest.approx(0.0, abs=1e-9) and fit["high"] == pytest.approx(
        0.0, abs=1e-9
    )


@pytest.mark.heavy
def test_three_abandoned_sessions_against_a_real_server(bench, tmp_path):
    bench.main(["--sessions", "3", "--models", "1"])
    [result] = (tmp_path / "results" / "tinker_session_memory").glob("*.json")
    figures = json.loads(result.read_text())["figures"]
    assert len(figures["rows"]) == 3
    assert all(row["server_mib"] > 100 and row["engine_mib"] > 100 for row in figures["rows"])
    assert math.isfinite(figures["server"]["mib_per_session"])
    assert figures["server"]["low"] is None  # two sessions after warm-up: no interval

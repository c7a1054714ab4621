"""The environment overhead benchmark's verifiers 0.4 case runs where verifiers 0.4 is installed
(`make test-verifiers`): `benchmarks/environment_overhead.py --shapes verifiers-v1` trains the
word-budget port (`benchmarks/word_budget_v1.py`) through the verifiers 0.4 adapter and the
same episodes through the native rollout, alternating, and reports the overhead per sampled
token from the pairs. A smoke test, not a measurement: two steps of a tiny model."""

from __future__ import annotations

import json

import pytest
from benchmark_runs import run_benchmark_here
from verifiers_v1_support import requires_verifiers_04

pytestmark = [requires_verifiers_04, pytest.mark.heavy]  # four short training runs: ~1 min


def test_the_verifiers_v1_case_trains_both_ways_and_pairs_them(tmp_path, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setenv("ASYNCGRPO_RESULTS_DIR", str(results))
    out = tmp_path / "environment_overhead.json"
    run_benchmark_here(
        "environment_overhead.py",
        *("--shapes", "verifiers-v1", "--steps", "2", "--repeats", "2", "--group", "2"),
        *("--groups", "1", "--max-tokens", "4", "--out", str(out), "--note", "smoke"),
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert [(r["way"], r["repeat"]) for r in result["runs"]] == [
        ("adapter", 0),
        ("native", 0),
        ("native", 1),
        ("adapter", 1),
    ]
    for run in result["runs"]:
        assert run["steps"] == 2 and run["ms_per_sampled_token"] > 0, run
        assert set(run["stop_reasons"]) <= {"ok", "length"}, run
    ways = result["summary"]["verifiers-v1"]
    adapter, native = ways["adapter"], ways["native"]
    # the same episodes both ways: two turns, the same prompts, the same sampled tokens
    assert adapter["turns_per_episode"] == native["turns_per_episode"] == 2.0
    assert adapter["sampled_per_episode"] == native["sampled_per_episode"]
    assert adapter["episode_tokens"] == pytest.approx(native["episode_tokens"], rel=0.05)
    assert len(ways["overhead_per_sampled_token_per_repeat"]) == 2
    assert ways["overhead_per_sampled_token"] > -1
    assert result["note"] == "smoke"
    (path,) = (results / "environment_overhead").glob("*.json")
    record = json.loads(path.read_text())
    assert "verifiers-v1 per sampled token %" in record["headline"]
    assert "--shapes verifiers-v1" in record["command"]

"""The GPU engine benchmark (`benchmarks/gpu_engine.py`) end to end on the CPU: the tiny
shape, a handful of short sequences, every system and the decode limit.

A smoke run measures nothing; it checks that a GPU session's one call of the script will
come back with figures: each system's tokens for each workload (or, for transformers'
continuous batching, a recorded reason it is unavailable), a positive decode-step limit
with the engine's step beside it, the JSON rewritten as it goes, and a result file with
its headline. And that a system that fails records its error while the others still run.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = [
    *("--shape", "tiny", "--device", "cpu", "--threads", "1", "--seed", "3"),
    *("--nano-sequences", "3", "--nano-min", "4", "--nano-max", "12"),
    *("--grpo-prompts", "2", "--grpo-samples", "2", "--grpo-prompt-len", "6"),
    *("--grpo-tokens", "6", "--prefill-chunk", "16", "--prefill-budget", "64"),
    *("--limit-batches", "2,4", "--limit-context", "16", "--limit-steps", "2"),
    *("--limit-warmup", "1", "--copy-mib", "4", "--matmul-size", "64"),
]


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("ASYNCGRPO_RESULTS_DIR", str(tmp_path / "results"))
    return importlib.import_module("gpu_engine")


def test_every_system_and_the_decode_limit_come_back_with_figures(bench, tmp_path):
    out = tmp_path / "gpu_engine.json"
    assert bench.main([*TINY, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == []
    assert report["workloads"]["nano"]["sequences"] == 3
    assert report["workloads"]["grpo256"]["output_tokens"] == 2 * 2 * 6
    by = {(r["system"], r["workload"]): r for r in report["results"]}
    assert set(by) == {(s, w) for s in bench.SYSTEMS for w in ("nano", "grpo256")}
    for (system, workload), row in by.items():
        if system == "continuous" and "unavailable" in row:
            assert "transformers" in row["unavailable"]  # says what is missing
            continue
        assert row["tokens"] == report["workloads"][workload]["output_tokens"], row
        assert row["seconds"] > 0 and row["tok_s"] > 0
    for workload in ("nano", "grpo256"):
        assert report["ratios"][workload]["embedded/generate"] > 0
    limit = report["limit"]
    assert limit["copy_gb_s"] > 0 and limit["matmul_tflops"] > 0
    assert [row["batch"] for row in limit["batches"]] == [2, 4]
    for row in limit["batches"]:
        assert row["limit_ms"] > 0 and row["weight_bytes"] > 0 and row["kv_bytes"] > 0
        assert row["step_ms"] > 0 and row["ratio"] == row["step_ms"] / row["limit_ms"]
    (result,) = (tmp_path / "results" / "gpu_engine").glob("*.json")
    headline = json.loads(result.read_text())["headline"]
    assert headline["embedded nano tok/s"] > 0 and "decode batch 4 step / limit" in headline


def test_a_failing_system_is_recorded_and_the_others_still_run(bench, tmp_path, monkeypatch):
    def broken(self, work):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(bench.GenerateSystem, "run", broken)
    out = tmp_path / "gpu_engine.json"
    argv = [*TINY, "--systems", "generate,embedded", "--workloads", "grpo256"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    by = {r["system"]: r for r in report["results"]}
    assert "out of memory, say" in by["generate"]["error"]
    assert by["embedded"]["tok_s"] > 0
    assert report["ratios"]["grpo256"]["embedded/generate"] is None
    assert any(e.startswith("generate/grpo256: RuntimeError") for e in report["errors"])


def test_continuous_batching_without_its_manager_or_at_all(bench, tmp_path, monkeypatch):
    """Releases without the manager: one timed `generate_batch` call, noted; without
    `generate_batch` either: unavailable, saying which transformers lacks it."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    argv = [*TINY, "--systems", "continuous", "--workloads", "grpo256,nano"]
    monkeypatch.setattr(importlib.import_module("gpu_engine_peers"), "has_manager", lambda m: 0)
    out = tmp_path / "one-batch.json"
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert all(r["note"].startswith("generate_batch") and r["tok_s"] > 0 for r in rows), rows
    monkeypatch.delattr(ContinuousMixin, "generate_batch")
    out = tmp_path / "none.json"
    assert bench.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["workload"] for r in report["results"]] == ["grpo256", "nano"]
    assert all("has no generate_batch" in r["unavailable"] for r in report["results"])
    assert report["errors"] == []

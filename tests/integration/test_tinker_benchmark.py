"""`benchmarks/tinker_overhead.py` and `benchmarks/tinker_offload.py` run end to end on the
tiny model and write their JSON."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("peft")

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy  # a server, its engine process and the SDK: ~25 s
def test_tinker_overhead_benchmark_runs(tmp_path, tiny_model_dir):
    module = load_script("tinker_overhead")
    out = tmp_path / "overhead.json"
    threads = torch.get_num_threads()  # the script sets the trainer's, for its process
    module.main(
        ["--model", str(tiny_model_dir), "--steps", "1", "--prompts", "2", "--group", "2",
         "--max-tokens", "4", "--rank", "4", "--out", str(out)]
    )  # fmt: skip
    torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert len(result["runs"]["api"]) == len(result["runs"]["direct"]) == 1
    assert set(result["overhead"]) == {"sample_s", "forward_backward_s", "optim_step_s", "step_s"}
    assert all(t > 0 for t in result["medians"]["api"].values())


@pytest.mark.heavy  # a server, its engine process and the SDK: ~15 s
def test_tinker_offload_benchmark_runs(tmp_path, tiny_model_dir):
    module = load_script("tinker_offload")
    out = tmp_path / "offload.json"
    threads = torch.get_num_threads()
    module.main(
        ["--model", str(tiny_model_dir), "--pairs", "2", "--warmup", "0", "--datums", "2",
         "--tokens", "8", "--rank", "4", "--samples", "2", "--max-tokens", "4",
         "--prompt-tokens", "4", "--phase-repeats", "1", "--out", str(out)]
    )  # fmt: skip
    torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    # each pair reloaded model A and the snapshot's weights once (the script checks which
    # call did), and the other model went out each time A came back
    assert len(result["pairs"]) == 2
    assert result["counts"]["model_reloads"] >= 2 and result["counts"]["snapshot_reloads"] >= 2
    for call in ("forward_backward", "sample"):
        assert result["summary"][call]["median_ratio"] > 0
    assert result["summary"]["model_file_mb"] > 0

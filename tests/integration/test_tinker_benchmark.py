"""`benchmarks/tinker_overhead.py` runs end to end on the tiny model and writes its JSON."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("peft")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "tinker_overhead.py"


@pytest.mark.heavy  # a server, its engine process and the SDK: ~25 s
def test_tinker_overhead_benchmark_runs(tmp_path, tiny_model_dir):
    spec = importlib.util.spec_from_file_location("tinker_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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

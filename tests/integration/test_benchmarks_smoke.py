"""Every script under `benchmarks/` runs: each on a tiny random model for a step or two.

These are smoke tests, not measurements: they run a script as its README shows it, with
flags that shrink it to seconds, and check what it wrote, so that a benchmark cannot rot
unseen (as `trl_baseline.py` did when a helper it imported moved). Each script's result
file goes to the test's own folder (`ASYNCGRPO_RESULTS_DIR`), never among the recorded
results in `benchmarks/results/`. The vLLM systems run in
`tests/vllm/test_benchmarks_vllm.py` (`make test-vllm`), the environment overhead
benchmark's verifiers 0.4 case in `test_verifiers_v1_benchmark.py` (`make test-verifiers`),
the Ray launchers and the 2-rank trainers in the tests below marked `ray` and `heavy`.
`vllm_env.sh` is the installer `make test-vllm` runs; `gpu_check.sh` needs a CUDA GPU (it
runs on a machine with one, and its steps are the scripts tested here).
"""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_runs import run_benchmark, run_benchmark_here, write_tiny_recipe
from safetensors.torch import load_file

LOCAL_SYSTEMS = "embedded,generate-bf16,generate-fp32"


def read_json(path):
    return json.loads(path.read_text())


@pytest.fixture(autouse=True)
def results_dir(tmp_path, monkeypatch):
    """Where the scripts write their result files (`benchmarks/result_files.py`) here."""
    folder = tmp_path / "results"
    monkeypatch.setenv("ASYNCGRPO_RESULTS_DIR", str(folder))
    return folder


def result_file(results_dir, benchmark: str) -> dict:
    """The one result file the benchmark wrote: its figures and what produced them."""
    (path,) = (results_dir / benchmark).glob("*.json")
    record = read_json(path)
    assert path.name == f"{record['date'][:10]}-{record['machine']['slug']}.json"
    assert record["benchmark"] == benchmark and f"benchmarks/{benchmark}.py" in record["command"]
    return record


@pytest.fixture(scope="module")
def tiny_recipe(tiny_model_dir, tmp_path_factory):
    return write_tiny_recipe(tmp_path_factory.mktemp("recipe"), tiny_model_dir)


def test_engine_throughput(tmp_path, results_dir):
    out = tmp_path / "engine_throughput.json"
    run_benchmark_here(
        "engine_throughput.py",
        *("--tiny", "--systems", LOCAL_SYSTEMS, "--threads", "1", "--max-num-seqs", "8"),
        *("--max-model-len", "128", "--out", str(out)),
    )
    report = read_json(out)
    results = {(r["system"], r["workload"]): r for r in report["results"]}
    assert set(results) == {
        (system, workload)
        for system in LOCAL_SYSTEMS.split(",")
        for workload in ("fixed64", "grpo256")
    }
    for (_, workload), result in results.items():
        assert result["tok_s"] > 0
        if workload == "fixed64":  # EOS ignored: every prompt gets exactly max_tokens
            assert result["tokens"] == 4 * 8
        else:  # 4 prompts x 2 samples, up to 8 tokens each
            assert 0 < result["tokens"] <= 4 * 2 * 8
    assert report["ratios"]["embedded/fixed64"]["vs_generate_bf16"] > 0
    assert all(0 < r["mfu"] < 1 for r in results.values())  # against the same run's matmul
    assert set(report["ceiling"]) == {"fixed64", "grpo256"}
    assert (tmp_path / "embedded.log").exists()
    record = result_file(results_dir, "engine_throughput")
    assert record["figures"]["results"] == report["results"]
    assert record["headline"]["embedded fixed64 tok/s"] > 0
    assert record["headline"]["fixed64 vs generate-bf16"] > 0


def test_trainer_speed(tmp_path, results_dir):
    out, profile = tmp_path / "trainer_speed.json", tmp_path / "profile.txt"
    run_benchmark_here(
        "trainer_speed.py",
        *("--shape", "tiny", "--threads", "1", "--groups", "2", "--group-size", "2"),
        *("--prompt-len", "8", "--completion-min", "4", "--completion-max", "12"),
        *("--steps", "1", "--warmup", "0", "--profile", str(profile), "--out", str(out)),
        *("--systems", "asyncgrpo,eager-head,other-autocast,padded"),
    )
    rows = {r["system"]: r for r in read_json(out)["rows"]}
    assert set(rows) == {"asyncgrpo", "eager-head", "other-autocast", "padded"}
    assert all(r["step_s"] > 0 and r["mfu"] > 0 for r in rows.values())
    assert "By input shape" in profile.read_text()
    record = result_file(results_dir, "trainer_speed")
    assert record["figures"]["rows"] == read_json(out)["rows"]
    assert record["headline"]["MFU %"] > 0 and record["headline"]["vs padded"] > 0


def test_attention_probe(tmp_path):
    out = tmp_path / "attention_probe.json"
    run_benchmark_here(
        "attention_probe.py",
        *("--shape", "tiny", "--threads", "1", "--groups", "3", "--group-size", "3"),
        *("--micro-batch-tokens", "600", "--repeats", "1", "--out", str(out)),
    )
    rows = read_json(out)["rows"]
    assert set(rows) == {"mask", "segments"}  # the varlen rows need a GPU
    assert all(r["forward_backward_ms"] > r["forward_ms"] > 0 for r in rows.values())
    assert rows["segments"]["max_diff_vs_mask"] < 1e-5


def test_server_load(tmp_path):
    out = tmp_path / "server_load.json"
    run_benchmark_here(
        "server_load.py",
        *("--tiny", "--clients", "6", "--idle", "2", "--slow", "1", "--hold", "3"),
        *("--max-tokens", "4", "--threads", "1", "--engine", "header_timeout_s=1"),
        *("--out", str(out)),
    )
    summary = read_json(out)["summary"]
    kinds = summary["kinds"]
    assert kinds["all"]["requests"] == kinds["all"]["ok"] == 6
    assert all(kinds[k]["ok"] == 2 for k in ("chat-stream", "complete-n4", "disconnect"))
    assert summary["tokens_per_s"] > 0 and summary["server_alive_after"]
    # the server's 1 s header timeout closed the idle connections within the 3 s hold
    assert summary["idle"]["ends"] == {"closed by server": 2}
    assert (tmp_path / "server_load.log").exists()


def test_request_log_cost(tmp_path, results_dir):
    out = tmp_path / "log_cost.json"
    run_benchmark_here(
        "request_log_cost.py",
        *("--tiny", "--arms", "off,text", "--rounds", "1", "--warmup", "0"),
        *("--clients", "3", "--max-tokens", "2", "--out", str(out)),
    )
    summary = read_json(out)["summary"]
    # one line per client request (and per /health probe) with the log on, none off
    assert summary["request_lines"]["off"] == 0 and summary["request_lines"]["text"] >= 3
    assert summary["arms"]["text"]["median_ratio"] > 0
    assert result_file(results_dir, "request_log_cost")["headline"]


def test_base_rate(tmp_path, tiny_model_dir, results_dir):
    out = tmp_path / "base_rate.json"
    run_benchmark_here(
        "base_rate.py",
        *("--model", str(tiny_model_dir), "--tasks", "word_count", "--prompts", "2"),
        *("--num-generations", "2", "--max-tokens", "4", "--threads", "1", "--dtype", "float32"),
        *("--json", str(out)),
    )
    (task,) = read_json(out)
    assert task["task"] == "word_count" and task["prompts"] == 2
    assert task["rewards"] == ["word_count_reward"]
    assert 0 < task["completion_tokens"] <= 4
    assert 0.0 <= task["sampled_reward"] <= 1.0 and 0.0 <= task["greedy_reward"] <= 1.0
    assert result_file(results_dir, "base_rate")["headline"]["word_count sampled"] >= 0


def test_head_passes(tmp_path, results_dir):
    out = tmp_path / "head_passes.json"
    run_benchmark_here(
        "head_passes.py", *("--rows", "96", "--repeats", "1", "--threads", "1", "--out", str(out))
    )
    result = read_json(out)
    assert set(result["rows"]) == {"eager", "fused"}
    assert all(row["forward_s"] > 0 and row["backward_s"] > 0 for row in result["rows"].values())
    assert result_file(results_dir, "head_passes")["figures"]["rows"] == result["rows"]


def test_lora_apply(tmp_path, tiny_model_dir):
    out = tmp_path / "lora_apply.json"
    run_benchmark_here(
        "lora_apply.py",
        *("--model", str(tiny_model_dir), "--batches", "1", "2", "--repeats", "1"),
        *("--syncs", "2", "--position", "8", "--out", str(out)),
    )
    result = read_json(out)
    assert [row["batch"] for row in result["decode"]] == [1, 2]
    assert all(row["decode_step_ms"] > 0 and row["lowrank_ms"] > 0 for row in result["decode"])
    assert result["sync"]["sync_ms"] > 0 and result["sync"]["first_sync_ms"] > 0


def test_lora(tmp_path, tiny_model_dir):
    """The LoRA mode: its steps, gathers and one sync into a real embedded engine."""
    out = tmp_path / "lora.json"
    run_benchmark_here(
        "lora.py",
        *("--model", str(tiny_model_dir), "--modes", "lora", "--groups", "1"),
        *("--group-size", "2", "--prompt-len", "8", "--completion-len", "17", "--steps", "1"),
        *("--gathers", "1", "--syncs", "1", "--out", str(out)),
        inline_children=True,  # its worker too
    )
    (result,) = read_json(out)["results"]
    assert result["mode"] == "lora"
    # A and B of q/k/v/o in each of the tiny model's 2 layers
    assert result["published_tensors"] == 2 * 4 * 2 and result["published_bytes"] > 0
    assert (
        0
        < result["trainable_params"]
        < sum(t.numel() for t in load_file(tiny_model_dir / "model.safetensors").values())
    )
    assert result["median_step_s"] > 0 and result["median_sync_s"] > 0


def test_train_step_packing(tmp_path, tiny_model_dir):
    out = tmp_path / "train_step_packing.json"
    run_benchmark_here(
        "train_step_packing.py",
        *("--model", str(tiny_model_dir), "--variants", "padded,packed_shared"),
        *("--repeats", "1", "--groups", "1", "--group-size", "2", "--prompt-min", "4"),
        *("--prompt-max", "8", "--completion-min", "2", "--completion-max", "8"),
        *("--threads", "1", "--out", str(out)),
        inline_children=True,  # its workers too
    )
    padded, shared = read_json(out)["results"]
    assert (padded["variant"], shared["variant"]) == ("padded", "packed_shared")
    assert padded["real_tokens"] == shared["real_tokens"]
    # one prompt for the group and no padding: fewer tokens through the model
    assert shared["forwarded_tokens"] < padded["real_tokens"] <= padded["forwarded_tokens"]
    assert padded["tokens_per_s"] > 0 and shared["tokens_per_s"] > 0


def data_parallel(tmp_path, *flags: str, run=run_benchmark_here) -> list[dict]:
    out = tmp_path / "data_parallel.json"
    run(
        "data_parallel.py",
        *("--tiny", "--steps", "1", "--groups", "1", "--group-size", "2", "--prompt-len", "8"),
        *("--completion-len", "20", "--out", str(out), *flags),
    )
    rows = read_json(out)["rows"]
    for row in rows:
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["published_mb"] > 0
    return rows


def test_data_parallel_one_process(tmp_path):
    (row,) = data_parallel(tmp_path, "--single")
    assert row["config"].startswith("1 process")


@pytest.mark.heavy  # 2 ranks twice: make test-heavy, which CI runs
def test_data_parallel_two_ranks(tmp_path):
    rows = data_parallel(tmp_path, run=run_benchmark)  # ranks of a child process of its own
    assert [r["config"].split(" (")[0] for r in rows] == [
        "1 process",
        "2 ranks ddp",
        "2 ranks fsdp",
    ]


def test_end_to_end_with_the_trl_baseline(tmp_path, tiny_recipe, tiny_model_dir):
    """asyncgrpo async and TRL's GRPOTrainer (`trl_baseline.py`) for 2 steps each, every
    snapshot scored afterwards."""
    out = tmp_path / "e2e"
    run_benchmark_here(
        "end_to_end.py",
        *("--recipe", str(tiny_recipe), "--systems", "async,trl", "--max-steps", "2"),
        *("--budget-s", "300", "--held-out", "4", "--score-steps", "1", "--trl-threads", "1"),
        *("--score-threads", "1", "--keep-weights", "--out", str(out)),
        timeout=600,  # trl_baseline.py keeps its process: here trl takes tests/vllm for vLLM
    )
    (run,) = read_json(out / "end_to_end.json")["runs"]
    systems = {row["system"]: row for row in run["systems"]}
    assert set(systems) == {"asyncgrpo async (staleness 2)", "TRL GRPOTrainer"}
    for row in systems.values():
        assert row["steps"] == 2 and row["samples_per_s"] > 0
        assert len(row["curve"]) == 3  # the initial model, then the snapshots of steps 1 and 2
    assert run["scored_rows"] == 4 and (out / "end_to_end.png").exists()

    trl = out / "trl"
    train = [json.loads(x) for x in (trl / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train if r["kind"] == "train"] == [1, 2]
    assert sorted(p.name for p in (trl / "weights").iterdir()) == [
        "step-000001.safetensors",
        "step-000002.safetensors",
    ]
    initial = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(trl / "final_model.safetensors")
    assert final.keys() == initial.keys()  # the tied LM head once, as asyncgrpo writes it
    assert any(not torch.equal(final[k], initial[k]) for k in initial)  # TRL trained


@pytest.mark.heavy  # two training runs and a scoring pass: ~30 s
def test_staleness_study_runs_then_resumes(tmp_path, tiny_recipe, capsys):
    """Two cells (sync and staleness 1) on one seed, two steps each, two at a time; the
    final weights scored afterwards; a rerun trains nothing and keeps the results."""
    out = tmp_path / "study"
    args = (
        *("--stage", "noise", "--recipe", str(tiny_recipe), "--seeds", "0", "--repeats", "1"),
        *("--steps", "2", "--jobs", "2", "--held-out", "4", "--score-threads", "1"),
        *("--out", str(out)),
    )
    run_benchmark_here("staleness_study.py", *args)
    results = sorted((out / "results").rglob("*.json"))
    assert [p.parent.name for p in results] == [
        "recipe-st0-truncated_is-lr3e-05",
        "recipe-st1-truncated_is-lr3e-05",
    ]
    runs = [read_json(p) for p in results]
    for run in runs:
        assert run["summary"]["steps"] == 2 and len(run["held_out_per_prompt"]) == 4
        assert 0 <= run["held_out_final"] <= 1 and run["wall_s"] > 0 and run["jobs"] == 2
        assert "trainer.num_threads=1" in run["overrides"]
        assert not (out / "runs" / run["cell"] / "seed0" / "weights").exists()  # dropped
    assert [r["summary"]["token_staleness_max"] for r in runs] == [0, 1]
    study = read_json(out / "noise" / "study.json")
    assert {name: c["area"]["n"] for name, c in study["cells"].items()} == {
        r["cell"]: 1 for r in runs
    }
    (diff,) = study["differences"]
    assert diff["area"]["seeds"] == [0]
    assert diff["area"]["mean"] == pytest.approx(
        runs[1]["summary"]["area"] - runs[0]["summary"]["area"]
    )
    assert (out / "noise" / "study.md").exists() and (out / "noise" / "study.png").exists()

    stamps = [p.stat().st_mtime_ns for p in results]
    capsys.readouterr()
    run_benchmark_here("staleness_study.py", *args)
    assert "2 runs: 2 done, 0 to train" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in results] == stamps


@pytest.mark.heavy  # four short training runs: ~60 s
def test_plan_against_runs(tmp_path, tiny_recipe):
    """Runs long enough for the engine's busy time (polled every 0.5 s) to show."""
    out = tmp_path / "plan"
    args = ("--recipe", str(tiny_recipe), "--steps", "24", "--from-step", "6", "--out", str(out))
    args += ("--set", "rollout.max_tokens=48", "--set", "rollout.num_generations=4")
    run_benchmark_here("plan_against_runs.py", *args, "--shared-cores", "2")
    rows = read_json(out / "plan_against_runs.json")["rows"]
    assert [r["run"] for r in rows] == [
        "staleness 0 (sync)",
        "staleness 1 (calibration run)",
        "staleness 2, no look-ahead cap",
        "two engine replicas, staleness 1",
    ]
    assert all(r["measured_samples_per_s"] > 0 and r["predicted_samples_per_s"] > 0 for r in rows)
    config = (out / "plan-two-engine-replicas" / "config.yaml").read_text()
    assert "replicas: 2" in config
    assert not list(out.glob("*/checkpoints"))  # dropped after each run


def test_ray_launcher_local(tmp_path, tiny_recipe):
    """The script's local launcher; the Ray ones run in the test marked `ray` below."""
    out = tmp_path / "ray_launcher.json"
    run_benchmark(
        "ray_launcher.py",
        *("--launchers", "local", "--recipe", str(tiny_recipe), "--steps", "2"),
        *("--repeats", "1", "--out", str(out)),
    )
    local = read_json(out)["median"]["local"]
    assert local["transport"] == "shm"
    assert local["samples_per_s"] > 0 and local["startup_s"] > 0


@pytest.mark.ray
def test_ray_launcher_every_launcher(tmp_path, tiny_recipe):
    pytest.importorskip("ray")
    out = tmp_path / "ray_launcher.json"
    run_benchmark(
        "ray_launcher.py",
        *("--recipe", str(tiny_recipe), "--steps", "2", "--repeats", "1", "--out", str(out)),
        timeout=600,
    )
    median = read_json(out)["median"]
    assert list(median) == ["local", "ray (new)", "ray (same node)", "ray (other node)"]
    assert median["ray (other node)"]["transport"] == "http"
    assert all(m["samples_per_s"] > 0 for m in median.values())


@pytest.mark.heavy  # six short training runs, an OpenEnv server among them: ~70 s
def test_environment_overhead(tmp_path):
    """Each adapter and its native rollout train 2 steps; both ways do the same episodes."""
    pytest.importorskip("openenv")
    pytest.importorskip("verifiers")
    out = tmp_path / "environment_overhead.json"
    run_benchmark_here(
        "environment_overhead.py",
        *("--steps", "2", "--repeats", "1", "--group", "2", "--groups", "1"),
        *("--max-tokens", "4", "--out", str(out)),
        timeout=600,
    )
    result = read_json(out)
    shapes = ("trl", "openenv", "verifiers")
    assert [(r["shape"], r["way"]) for r in result["runs"]] == [
        (shape, way) for shape in shapes for way in ("adapter", "native")
    ]
    for run in result["runs"]:
        assert run["steps"] == 2 and run["steps_per_s"] > 0
        assert set(run["stop_reasons"]) <= {"ok", "length"}, run
    # the random model writes no tool call: one reply per episode, verifiers' two turns
    turns = {"trl": 1.0, "openenv": 1.0, "verifiers": 2.0}
    for shape, ways in result["summary"].items():
        for way in ("adapter", "native"):
            assert ways[way]["turns_per_episode"] == turns[shape], (shape, way)
        assert ways["adapter"]["completion_len_mean"] == ways["native"]["completion_len_mean"]
        # the same prompts (tool description, worked example, observations) both ways
        assert ways["adapter"]["episode_tokens"] == pytest.approx(
            ways["native"]["episode_tokens"], rel=0.05
        )
        (adapter,) = [r for r in result["runs"] if (r["shape"], r["way"]) == (shape, "adapter")]
        assert ways["adapter"]["steps_per_s"] == adapter["steps_per_s"]  # one repeat
        assert ways["overhead"] > -1

"""Calibration recovers the costs put into a hand-written run directory; the CLI plans from it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from asyncgrpo.plan import PlanInputError
from asyncgrpo.plan.calibrate import calibrate
from asyncgrpo.plan.cli import main
from asyncgrpo.plan.costs import costs_from_mapping, load_cost_model
from asyncgrpo.plan.simulate import Simulation

PROMPT, BG, G = 30, 2, 4
TRAIN_BASE, PER_TOKEN, SYNC, PAUSE, BUSY_RATE = 0.5, 0.002, 0.3, 0.1, 400.0


def write_run(path, lengths_by_step: list[list[int]]) -> None:
    """A run of len(lengths_by_step) steps whose costs are the constants above."""
    path.mkdir()
    config = {
        "coordinator": {"batch_groups": BG, "max_staleness": 1, "max_ahead_batches": 1.0},
        "rollout": {"num_generations": G},
        "engine": {"replicas": 1, "max_num_seqs": 64},
        "trainer": {"num_processes": 1},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    rows, samples, t = [], [], 0.0
    for step, lengths in enumerate(lengths_by_step, start=1):
        tokens = sum(lengths) + PROMPT * len(lengths)
        step_s = TRAIN_BASE + PER_TOKEN * tokens
        t += 4.0
        busy = 0.5  # the engine generated this step's tokens in 2 of its 4 seconds
        rows.append(
            {
                "kind": "train",
                "step": step,
                "time_s": t,
                "train_step_s": step_s,
                "train_tokens_per_s": tokens / step_s,
                "weight_sync_s": SYNC,
                "engine_pause_s": PAUSE,
                "gen_tokens_per_s": BUSY_RATE * busy,
                "engine_busy_ratio": busy,
            }
        )
        for g in range(BG):
            mine = lengths[g * G : (g + 1) * G]
            samples.append({"step": step, "samples": [{"completion_tokens": n} for n in mine]})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (path / "samples.jsonl").write_text("\n".join(json.dumps(s) for s in samples) + "\n")


@pytest.fixture
def run_dir(tmp_path):
    steps = [[10 + 3 * s + i for i in range(BG * G)] for s in range(6)]
    write_run(tmp_path / "run", steps)
    return tmp_path / "run", steps


def test_calibration_recovers_the_costs_put_in(run_dir):
    path, steps = run_dir
    costs, lengths, layout = calibrate(path, skip=0)
    assert costs.train_base_s == pytest.approx(TRAIN_BASE, rel=1e-6)
    assert costs.train_per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)
    assert costs.sync_transfer_s == pytest.approx(SYNC - PAUSE)
    assert costs.pause_s == pytest.approx(PAUSE)
    assert lengths.prompt_tokens == PROMPT
    assert sorted(lengths.completions) == sorted(n for s in steps for n in s)
    assert (layout.batch_groups, layout.num_generations, layout.max_staleness) == (BG, G, 1)
    # the decode scale reproduces the measured busy token rate on the run's own layout
    sim = Simulation(layout, costs, lengths, seed=0)
    sim.run(12)
    busy = sum(b - a for e in sim.engines for a, b in e.busy)
    assert sum(e.generated for e in sim.engines) / busy == pytest.approx(BUSY_RATE, rel=0.02)


def test_calibration_names_what_is_missing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    with pytest.raises(PlanInputError, match="no train rows"):
        calibrate(tmp_path)


def test_cost_model_from_device_figures(tmp_path):
    spec = {
        "decode_tokens_per_s": 2000,
        "decode_batch": 64,
        "decode_latency_s": 0.011,
        "train_tokens_per_s": 5000,
        "model_gb": 16,
        "sync_gb_per_s": 8,
        "pause_s": 0.5,
        "lengths": {"median": 500, "sigma": 1.0, "max_tokens": 4096, "prompt_tokens": 200},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    costs, lengths = load_cost_model(tmp_path / "c.yaml")
    assert costs.decode_step_s(1, 0) == pytest.approx(0.011)
    assert costs.decode_step_s(64, 0) == pytest.approx(64 / 2000)
    assert costs.train_step_s(5000, 1) == pytest.approx(1.0)
    assert costs.sync_transfer_s == pytest.approx(2.0)
    assert max(lengths.completions) == 4096 and lengths.prompt_tokens == 200
    with pytest.raises(PlanInputError, match="unknown field"):
        costs_from_mapping({**spec, "decode_tokens_per_sec": 1})


def test_cli_plans_a_grid_and_picks_the_fastest_within_budget(run_dir, tmp_path, capsys):
    path, _ = run_dir
    out = tmp_path / "plan.json"
    argv = ["--from", str(path), "--engines", "1,2", "--staleness", "0,1", "--budget", "2"]
    assert main([*argv, "--steps", "12", "--json", str(out)]) == 0
    assert "fastest within 2 devices" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4
    fits = [r for r in result["rows"] if r["devices"] <= 2]
    assert result["fastest"]["samples_per_s"] == max(r["samples_per_s"] for r in fits)
    assert result["fastest"]["engines"] == 1


def test_cli_error_is_one_line(tmp_path, capsys):
    assert main(["--from", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read")


def test_planning_imports_no_torch():
    code = "import sys, asyncgrpo.plan.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_shares_one_hosts_cores_among_the_roles(run_dir, tmp_path):
    """The run's engine and trainer (a thread each) overlap at staleness 1: on one core
    they slow each other, on two they do not."""
    path, _ = run_dir
    rates = {}
    for cores in ("1", "2"):
        out = tmp_path / f"plan{cores}.json"
        argv = ["--from", str(path), "--staleness", "1", "--shared-cores", cores]
        assert main([*argv, "--steps", "12", "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["rows"]
        assert row["shared_cores"] == float(cores)
        rates[cores] = row["samples_per_s"]
    out = tmp_path / "own.json"
    assert main(["--from", str(path), "--staleness", "1", "--steps", "12", "--json", str(out)]) == 0
    (own,) = json.loads(out.read_text())["rows"]
    assert rates["1"] < rates["2"] == pytest.approx(own["samples_per_s"], rel=1e-9)


def test_a_field_the_run_left_out_takes_the_runs_default_not_the_planners(tmp_path):
    from asyncgrpo.base.config import EmbeddedEngineConfig, RunConfig
    from asyncgrpo.plan.calibrate import run_layout

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"coordinator": {"batch_groups": 3}}))
    layout = run_layout(tmp_path)
    defaults = RunConfig()
    assert layout.batch_groups == 3
    assert layout.max_num_seqs == EmbeddedEngineConfig().max_num_seqs
    assert layout.max_staleness == defaults.coordinator.max_staleness
    assert layout.num_generations == defaults.rollout.num_generations
    assert layout.trainer_threads == defaults.trainer.num_threads


def test_a_vllm_runs_batch_is_its_max_num_seqs_argument(tmp_path):
    from asyncgrpo.plan.calibrate import VLLM_MAX_NUM_SEQS, run_layout

    engine = {"type": "vllm", "replicas": 2, "vllm_args": ["--max-num-seqs", "96"]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"engine": engine}))
    layout = run_layout(tmp_path)
    assert (layout.engines, layout.max_num_seqs) == (2, 96)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"engine": {"type": "vllm"}}))
    assert run_layout(tmp_path).max_num_seqs == VLLM_MAX_NUM_SEQS


def test_a_config_the_models_reject_is_a_plan_input_error_naming_the_field(tmp_path):
    from asyncgrpo.plan.calibrate import run_layout

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"coordinator": {"batch_groupz": 3}}))
    with pytest.raises(PlanInputError, match="batch_groupz"):
        run_layout(tmp_path)


def test_reading_a_runs_layout_loads_no_torch(tmp_path):
    write_run(tmp_path / "run", [[10, 11, 12, 13, 14, 15, 16, 17]] * 3)
    code = (
        "import sys; from asyncgrpo.plan.calibrate import run_layout; "
        f"run_layout(__import__('pathlib').Path({str(tmp_path / 'run')!r})); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""The planner's inputs for published systems: a colocated synchronous baseline, a log-prob
pass, costs from a data sheet, an empirical length law. Checked against hand-worked cases."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml

from asyncgrpo.plan import Costs, Deployment, Lengths, PlanInputError, predict
from asyncgrpo.plan.cli import main
from asyncgrpo.plan.costs import costs_from_mapping, lengths_from_mapping, load_cost_model
from asyncgrpo.plan.datasheet import costs_from_device

L, P, G, BG = 100, 10, 8, 4
B = G * BG


def costs(**kw) -> Costs:
    base = dict(
        decode_base_s=0.02,
        decode_per_seq_s=0.001,
        train_per_token_s=0.001,
        logprob_per_token_s=0.0004,
        sync_transfer_s=5.0,  # a colocated step must not pay it
        switch_s=0.7,
        pause_s=0.05,
        rank_efficiency=1.0,
    )
    return Costs(**{**base, **kw})


def test_colocated_sync_step_is_generate_then_train_on_the_pool_then_switch():
    c = costs()
    engines, ranks = 4, 8
    lay = Deployment(
        engines=engines,
        trainer_ranks=ranks,
        max_staleness=0,
        batch_groups=BG,
        num_generations=G,
        colocated=True,
        logprob_pass=True,
    )
    p = predict(lay, c, Lengths.constant(L, P))
    # least-outstanding routing puts one group of G on each engine: B / engines per step
    per_engine = B // engines
    generate = L * (c.decode_base_s + c.decode_per_seq_s * per_engine)
    tokens = B * (P + L)
    train = tokens * (c.train_per_token_s + c.logprob_per_token_s) / ranks  # efficiency 1
    assert p.step_s == pytest.approx(generate + train + c.switch_s + c.pause_s, rel=0.01)
    without = predict(replace(lay, logprob_pass=False), c, Lengths.constant(L, P))
    assert p.step_s - without.step_s == pytest.approx(
        tokens * c.logprob_per_token_s / ranks, rel=0.01
    )


def test_a_colocated_pool_cannot_run_ahead():
    lay = Deployment(max_staleness=1, colocated=True)
    with pytest.raises(PlanInputError, match="max_staleness 0"):
        predict(lay, costs(), Lengths.constant(L, P))


def test_data_sheet_costs_by_hand():
    spec = {
        "params_b": 1.0,  # 2 GB of bf16 weights
        "kv_bytes_per_token": 1000,
        "hbm_tb_s": 2.0,
        "bf16_tflops": 100,
        "tp": 2,
        "bandwidth_util": 0.5,  # 2 TB/s for the 2-device engine
        "flop_util": 0.5,
        "step_floor_s": 0.003,
        "train_flops_per_param_token": 8,
        "sync_gb_per_s": 4,
    }
    out = costs_from_device(spec)
    assert out["decode_base_s"] == pytest.approx(0.003 + 2e9 / 2e12)
    assert out["decode_per_ctx_s"] == pytest.approx(1000 / 2e12)
    assert out["decode_per_seq_s"] == pytest.approx(2e9 / 100e12)  # 2 devices at half peak
    assert out["train_per_token_s"] == pytest.approx(8e9 / 50e12)  # one rank at half peak
    assert out["logprob_per_token_s"] == pytest.approx(2e9 / 50e12)
    assert out["sync_transfer_s"] == pytest.approx(0.5)
    with pytest.raises(PlanInputError, match="unknown field"):
        costs_from_device({**spec, "hbm_gb_s": 1})
    with pytest.raises(PlanInputError, match="bf16_tflops"):
        costs_from_device({k: v for k, v in spec.items() if k != "bf16_tflops"})


def test_fields_given_directly_win_over_the_data_sheet():
    device = {"params_b": 1.0, "kv_bytes_per_token": 0, "hbm_tb_s": 1.0, "bf16_tflops": 100,
              "bandwidth_util": 1.0, "flop_util": 1.0}  # fmt: skip
    c = costs_from_mapping({"device": device, "train_tokens_per_s": 1000, "sync_s": 2.0})
    assert c.train_per_token_s == pytest.approx(1e-3)
    assert c.decode_base_s == pytest.approx(2e9 / 1e12)
    assert c.sync_transfer_s == 2.0


def test_empirical_length_law():
    lengths = lengths_from_mapping({"values": [10, 1000], "weights": [3, 1], "prompt_tokens": 7})
    draws = lengths.sampler(np.random.default_rng(0))(4000)
    assert set(draws.tolist()) == {10, 1000} and lengths.prompt_tokens == 7
    assert (draws == 1000).mean() == pytest.approx(0.25, abs=0.03)
    with pytest.raises(PlanInputError, match="one weight each"):
        lengths_from_mapping({"values": [10, 20], "weights": [1]})


def test_cli_colocated_counts_the_pool_once(tmp_path, capsys):
    spec = {"decode_base_s": 0.01, "decode_per_seq_s": 1e-4, "train_per_token_s": 1e-5,
            "switch_s": 1.0, "lengths": {"constant": 50, "prompt_tokens": 10}}  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    argv = ["--costs", str(tmp_path / "c.yaml"), "--engines", "8", "--trainer-ranks", "8"]
    assert main([*argv, "--staleness", "0", "--colocated", "--steps", "6"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[6] == "coloc" and row[7] == "8"
    assert main([*argv, "--staleness", "1", "--colocated"]) == 2
    assert "--colocated needs --staleness 0" in capsys.readouterr().err


def test_published_cost_models_load():
    from pathlib import Path

    folder = Path(__file__).parents[2] / "benchmarks" / "plan_published"
    models = sorted(folder.glob("*.yaml"))
    assert models
    for path in models:
        c, lengths = load_cost_model(path)
        assert c.decode_base_s > 0 and c.train_per_token_s > 0 and lengths.completions

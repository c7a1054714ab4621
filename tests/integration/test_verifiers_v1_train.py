"""Slow: SmolLM2-135M learns the verifiers 0.4 tool environment of
examples/verifiers_warehouse (recipes/verifiers_warehouse.yaml) in a few steps on CPU:
its held-out reward (both reward columns, weighted as the environment weighs them) rises
from the first evaluation to the last, and the model asks the tool more often
(measured: 0.51 -> 1.13 of at most 1.5, tool calls per episode 0.56 -> 0.91, in 3 steps;
10.5 minutes on 2 busy cores)."""

from __future__ import annotations

import pytest
from test_train import read_jsonl
from verifiers_v1_support import REPO, importable, requires_verifiers_04

from asyncgrpo.base.config import load_config
from asyncgrpo.run.loop import train

pytestmark = [requires_verifiers_04, pytest.mark.slow]


def test_smollm2_learns_the_verifiers_warehouse_tool_environment(tmp_path, monkeypatch):
    importable(monkeypatch, REPO / "examples" / "verifiers_warehouse")  # as if installed
    cfg = load_config(
        REPO / "recipes" / "verifiers_warehouse.yaml",
        [f"output_dir={tmp_path}", "max_steps=3", "eval_steps=3", "checkpoint_steps=100"],
    )
    run_dir = train(cfg)

    evals = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 3, evals
    assert last["eval_reward_mean"] > first["eval_reward_mean"] + 0.1, evals
    assert last["eval_tool_calls_per_episode"] > first["eval_tool_calls_per_episode"], evals
    assert "eval_score_stated_count" in last and "eval_score_asked_right_item" in last

"""Slow: SmolLM2-135M trains on the verifiers example (recipes/verifiers_word_budget.yaml)
on CPU for a few steps and its held-out reward (the rubric's, sampled episodes) rises."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train import read_jsonl

from asyncgrpo.base.config import load_config
from asyncgrpo.run.loop import train

pytestmark = pytest.mark.slow
pytest.importorskip("verifiers")
REPO = Path(__file__).parents[2]


def test_smollm2_learns_the_verifiers_word_budget_example(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe names the example module from the repository root
    cfg = load_config(
        REPO / "recipes" / "verifiers_word_budget.yaml",
        [f"output_dir={tmp_path}", "max_steps=20", "max_time_s=1500", "checkpoint_steps=100"],
    )
    run_dir = train(cfg)

    evals = [x for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "eval"]
    assert len(evals) >= 2, evals
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] >= 15, evals
    assert last["eval_reward_mean"] > first["eval_reward_mean"] + 0.05, evals
    assert "eval_rubric_word_budget" in last and "eval_rubric_shortest_exact_bonus" in last

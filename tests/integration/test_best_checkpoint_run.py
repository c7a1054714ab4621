"""A run keeps its best held-out evaluation's weights, and export writes them by default."""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file
from test_train import read_jsonl, run_api
from transformers import AutoModelForCausalLM

from asyncgrpo.run.export import export_run
from asyncgrpo.testing import even_token_reward, tiny_prompt_rows


def test_the_best_evaluation_is_kept_bit_for_bit_and_exported(tmp_path, tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="asyncgrpo.run.loop"):
        run_dir = run_api(
            tmp_path,
            tiny_model_dir,
            "best",
            tiny_prompt_rows(40),
            [even_token_reward],
            eval_rows=tiny_prompt_rows(6),
            max_steps=6,
            eval_steps=2,
            save_weights_steps=1,  # every step's weights, to compare the kept ones with
        )
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
    assert len(evals) >= 2
    top = max(r["eval_reward_mean"] for r in evals)
    best_step = next(r["step"] for r in evals if r["eval_reward_mean"] == top)  # ties: earliest
    kept = load_file(run_dir / "best" / "model.safetensors")
    if best_step == 0:
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        expected = {name: initial[name] for name in kept}
    else:
        expected = load_file(run_dir / "weights" / f"step-{best_step:06d}.safetensors")
    assert kept.keys() == expected.keys()
    assert all(torch.equal(kept[k], expected[k]) for k in kept)
    assert f"at step {best_step}" in caplog.text

    said = export_run(run_dir, tmp_path / "exported")
    assert said.startswith(f"step {best_step} model from {run_dir / 'best'}")
    said = export_run(run_dir, tmp_path / "last", last=True)
    assert said.startswith("step 6 model")

"""What a TRL user passes to `AsyncGRPOTrainer`: every dataset form, a model object with its
`processing_class`, rewards by dotted path from the current directory, and `save_model`.
Mistakes in them are reported before any engine process starts, in one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.base.config import ConfigError
from asyncgrpo.learning.rollout.data import DatasetError, dataset_rows
from asyncgrpo.testing import engine_children, even_token_reward, tiny_prompt_rows

ROWS = tiny_prompt_rows(40)


def args(tmp_path: Path, name: str, **overrides):
    settings = {
        "output_dir": str(tmp_path),
        "run_name": name,
        "max_steps": 2,
        "eval_steps": 100,
        "save_steps": 1,
        "num_generations": 4,
        "max_completion_length": 8,
        "per_device_train_batch_size": 8,  # 2 prompts x 4 completions per step
        "learning_rate": 1e-3,
        "report_to": "none",
        "engine.dtype": "float32",
        "engine.max_num_seqs": 16,
        "engine.max_model_len": 128,
        "rollout.filter_zero_variance": False,
        "trainer.bf16_autocast": False,
        "trainer.micro_batch_tokens": 96,
    }
    settings.update(overrides)
    return AsyncGRPOConfig(**settings)


@pytest.fixture
def isolated_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_dataset_forms_become_checked_rows(tmp_path):
    ds = datasets.Dataset.from_list(ROWS[:3])
    assert dataset_rows(ds, "train_dataset") == ROWS[:3]
    splits = datasets.DatasetDict(train=ds, test=datasets.Dataset.from_list(ROWS[3:4]))
    assert dataset_rows(splits, "train_dataset") == ROWS[:3]
    assert dataset_rows(splits, "eval_dataset", ("test", "validation")) == ROWS[3:4]
    assert dataset_rows(ROWS[:2], "train_dataset") == ROWS[:2]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    assert dataset_rows(str(path), "train_dataset") == ROWS[:2]
    with pytest.raises(DatasetError, match=r"has no 'train' split \(splits: test\)"):
        dataset_rows(datasets.DatasetDict(test=ds), "train_dataset")
    with pytest.raises(DatasetError, match=r"expected a datasets.Dataset, .* got dict"):
        dataset_rows({"prompt": ["a"]}, "train_dataset")


def test_missing_prompt_column_is_named_before_the_engine_starts(tmp_path, tiny_model_dir):
    ds = datasets.Dataset.from_list([{"question": "2+2?", "answer": "4"}] * 4)
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=even_token_reward,
        train_dataset=ds,
        args=args(tmp_path, "no-prompt"),
    )
    with pytest.raises(ConfigError, match=r"train_dataset: row 0 has no 'prompt' column") as err:
        trainer.train()
    assert "['answer', 'question']" in str(err.value)
    assert engine_children() == []
    assert not (tmp_path / "no-prompt").exists()  # nothing started, nothing written


def test_bad_reward_path_fails_before_the_engine_starts(tmp_path, tiny_model_dir):
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs="no_such_rewards_module:score",
        train_dataset=ROWS,
        args=args(tmp_path, "bad-reward"),
    )
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_rewards_module'"):
        trainer.train()
    assert engine_children() == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"rewards": ["no_such_rewards_module:score"]}, "cannot import module"),
        ({"dataset": {"path": "ROWS_WITHOUT_PROMPT"}}, "row 0 has no 'prompt' column"),
    ],
)
def test_cli_reports_input_mistakes_without_a_traceback(tmp_path, tiny_model_dir, change, expected):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "2+2?"}) + "\n")
    recipe = {
        "name": "cli",
        "output_dir": str(tmp_path),
        "model": {"name_or_path": str(tiny_model_dir)},
        "dataset": {"path": str(data).replace("rows", "good")},
        "rewards": ["asyncgrpo.testing:even_token_reward"],
    }
    (tmp_path / "good.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    recipe.update(json.loads(json.dumps(change).replace("ROWS_WITHOUT_PROMPT", str(data))))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    done = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli", "train", str(tmp_path / "r.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert expected in output and "Traceback" not in output
    assert "engine" not in output.lower()  # it never started one


@pytest.mark.heavy  # a second API training run (the model-object one stays in make test)
def test_string_path_dataset_trains(tmp_path, tiny_model_dir):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    run_dir = AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=even_token_reward,
        train_dataset=str(path),
        args=args(tmp_path, "path", max_steps=1),
    ).train()
    assert (run_dir / "checkpoints" / "step-000001").is_dir()


def test_model_object_trains_and_saves_a_loadable_model(
    tmp_path, tiny_model_dir, monkeypatch, isolated_sys_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a reward module in the current directory, named by dotted path as users do
    work = tmp_path / "work"
    work.mkdir()
    (work / "api_inputs_rewards.py").write_text(
        textwrap.dedent(
            """
            def reward_even(prompts, completions, completion_ids, **kwargs):
                return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
            """
        )
    )
    monkeypatch.chdir(work)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    splits = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:2])
    )
    trainer = AsyncGRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs="api_inputs_rewards.reward_even",
        train_dataset=splits,
        args=args(tmp_path, "object", max_steps=4, save_total_limit=3),
    )
    run_dir = trainer.train()
    assert (run_dir / "initial_model" / "tokenizer_config.json").is_file()
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert steps == ["step-000002", "step-000003", "step-000004"]  # save_total_limit=3

    out = tmp_path / "hf"
    assert trainer.save_model(out) == out
    loaded = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    trained = load_file(run_dir / "checkpoints" / "step-000004" / "model.safetensors")
    state = loaded.state_dict()
    assert trained and all(torch.equal(state[k], v.float()) for k, v in trained.items())
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in trained.items())  # it trained

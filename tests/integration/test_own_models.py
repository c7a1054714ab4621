"""A user's own model in the embedded engine: its context limit is respected, a model the
engine cannot start says why on the console (not only an exit code), an architecture it
does not run names the alternative that exists, and `asyncgrpo serve --model` takes a run's
checkpoint or weights snapshot as well as a model directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from asyncgrpo import cli
from asyncgrpo.base.config import EmbeddedEngineConfig, EngineSettings, RunConfig
from asyncgrpo.base.engine_errors import EngineStartError
from asyncgrpo.inference.engine.engine import Engine
from asyncgrpo.inference.engine.process import EngineProcess, last_words
from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.learning.trainer.checkpoint import (
    TrainingState,
    copy_weights,
    save_checkpoint,
    write_weights,
)
from asyncgrpo.testing import build_tiny_tokenizer, save_tiny_model_dir

PROMPT = [5, 17, 42, 99, 230, 7]


def engine_config(model: Path | str, **settings) -> EmbeddedEngineConfig:
    return EmbeddedEngineConfig(model=str(model), dtype="float32", num_threads=1, **settings)


# ---- the context limit ----------------------------------------------------------


def test_a_model_with_a_short_context_gets_its_own_limit(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "short", max_position_embeddings=128)
    assert EmbeddedEngineConfig().max_model_len is None  # the default leaves it to the model
    engine = Engine(engine_config(model_dir))
    assert engine.max_model_len == 128
    with pytest.raises(RequestError, match="max_model_len=256 exceeds .*=128"):
        Engine(engine_config(model_dir, max_model_len=256))


def test_a_long_context_is_capped_by_default(tmp_path):
    model_dir = save_tiny_model_dir(tmp_path / "long", max_position_embeddings=8192)
    assert Engine(engine_config(model_dir)).max_model_len == 4096


# ---- a failed start explains itself --------------------------------------------------


@pytest.fixture
def unsupported_model_dir(tmp_path) -> Path:
    """A config.json of an architecture the embedded engine does not run (no weights needed:
    the check comes before they load)."""
    from transformers import GPT2Config

    path = tmp_path / "gpt2-like"
    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100).save_pretrained(path)
    return path


def test_unsupported_architecture_names_an_alternative_that_exists(unsupported_model_dir):
    with pytest.raises(RequestError) as error:
        Engine(engine_config(unsupported_model_dir))
    message = error.value.message
    assert "model_type 'gpt2'" in message and "llama" in message
    assert "engine.type: vllm" in message  # a real engine.type value
    assert "vllm" in EngineSettings.model_fields["type"].annotation.__args__
    assert "--upstream-url" in message  # a real `asyncgrpo serve` flag


@pytest.mark.heavy
def test_engine_process_failure_carries_the_cause_from_its_log(tmp_path, unsupported_model_dir):
    log = tmp_path / "engine.log"
    log.write_text("an earlier run's last line\n")  # the log is appended to: not this start's
    for log_path in (log, None):
        proc = EngineProcess(engine_config(unsupported_model_dir), log_path=log_path)
        proc.start()
        try:
            with pytest.raises(EngineStartError) as error:
                proc.wait_ready(120)
        finally:
            proc.stop()
        message = str(error.value)
        assert "exited with code 2" in message
        assert "model_type 'gpt2'" in message and "engine.type: vllm" in message
        assert "earlier run" not in message
        assert (str(log) in message) == (log_path is not None)


@pytest.mark.heavy
def test_train_on_an_unsupported_architecture_prints_the_cause(tmp_path):
    """End to end through `asyncgrpo train`: a GPT-2 directory with weights and a tokenizer
    (the trainer loads it; the embedded engine refuses it), the cause from engine.log on the
    console, non-zero."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tiny_tokenizer()
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    model_dir = tmp_path / "gpt2-like"
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    recipe = {
        "name": "gpt2",
        "output_dir": str(tmp_path),
        "max_steps": 2,
        "model": {"name_or_path": str(model_dir)},
        "engine": {"dtype": "float32", "num_threads": 1, "max_model_len": 128},
        "dataset": {"builtin": "word_count", "size": 8, "eval_size": 2},
        "rewards": ["word_count_reward"],
        "rollout": {"num_generations": 2, "max_tokens": 4},
        "coordinator": {"batch_groups": 1},
    }
    (tmp_path / "gpt2.yaml").write_text(yaml.safe_dump(recipe))
    out = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli", "train", str(tmp_path / "gpt2.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    console = out.stdout + out.stderr
    assert out.returncode != 0, console[-3000:]
    assert "run aborted: the engine did not start: engine process exited with code 2" in console
    assert "model_type 'gpt2' is not one the embedded engine runs" in console, console[-3000:]
    assert "engine.type: vllm" in console
    assert "model_type 'gpt2'" in (tmp_path / "gpt2" / "engine.log").read_text()
    assert "Traceback" not in console


@pytest.mark.heavy
def test_serve_on_a_broken_model_prints_the_cause(tmp_path):
    broken = save_tiny_model_dir(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli", "serve", "--model", str(broken)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: cannot load model from {broken}: SafetensorError")
    assert "Traceback" not in out.stderr
    # the same start inside a run: the engine process's error carries that line
    proc = EngineProcess(engine_config(broken), log_path=tmp_path / "engine.log")
    proc.start()
    try:
        with pytest.raises(EngineStartError, match="code 2 .*: cannot load model .*Safetensor"):
            proc.wait_ready(120)
    finally:
        proc.stop()


def test_last_words_pick_the_error_line_or_the_exception():
    assert last_words("loading\nerror: no such model\n") == "no such model"
    crash = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom\n'
    assert last_words("INFO start\n" + crash) == "RuntimeError: boom"
    assert last_words("".join(f"line {i}\n" for i in range(9))) == (
        "line 4 | line 5 | line 6 | line 7 | line 8"
    )
    assert last_words("") == ""


# ---- serving a run's checkpoint -------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory as a run leaves it: config.yaml naming the base model, a checkpoint of
    step 3 written by `save_checkpoint`, a weights snapshot of step 2; and the trained model."""
    root = tmp_path_factory.mktemp("own-models")
    base_dir = save_tiny_model_dir(root / "base")
    run_dir = root / "run"
    run_dir.mkdir()
    cfg = RunConfig(model={"name_or_path": str(base_dir)})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(step=3, version=3, data_position={}, extra={})
    save_checkpoint(run_dir / "checkpoints", model, optimizer, None, state)
    (run_dir / "weights").mkdir()
    write_weights(run_dir / "weights" / "step-000002.safetensors", copy_weights(model))
    return run_dir, model.eval(), base_dir


def reference_logprobs(model, completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + completion])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(completion)]


def sample(proc: EngineProcess, name: str) -> tuple[list[int], list[float]]:
    response = httpx.post(
        f"{proc.base_url}/v1/completions",
        json={
            "model": name,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 1,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(
    "weights",
    [
        "checkpoints/step-000003",
        pytest.param("weights/step-000002.safetensors", marks=pytest.mark.heavy),
    ],
)
def test_serve_loads_a_run_checkpoint_and_generates_with_its_weights(
    tmp_path, trained_run, weights
):
    run_dir, trained, base_dir = trained_run
    path = run_dir / weights
    assert not (path / "config.json").exists()  # not a model directory by itself
    log = tmp_path / "engine.log"
    proc = EngineProcess(engine_config(path), log_path=log)
    proc.start()
    try:
        proc.wait_ready(180)
        ids, logprobs = sample(proc, str(path))
    finally:
        proc.stop()
    assert len(ids) == 8
    error = max(abs(a - b) for a, b in zip(reference_logprobs(trained, ids), logprobs))
    assert error < 1e-4
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_error = max(abs(a - b) for a, b in zip(reference_logprobs(base, ids), logprobs))
    assert base_error > 1e-2  # the trained weights, not the base model's
    assert "written to" in log.read_text()  # what was exported for serving


def test_serve_names_an_incomplete_checkpoint_and_the_steps_there_are(
    tmp_path, trained_run, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run[0], run_dir)
    incomplete = run_dir / "checkpoints" / "step-000007"  # died before its state.json
    incomplete.mkdir()
    assert cli.main(["serve", "--model", str(incomplete)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot serve step 7 of {run_dir}")
    assert "available: 2, 3" in err and "\n" not in err.strip()

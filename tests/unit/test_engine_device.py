"""`engine.device`: the CPU by default; `cuda` refused with what exists and what is missing,
unless the experimental gate is set, and then only over a paged KV cache."""

from __future__ import annotations

import pytest

from asyncgrpo import cli
from asyncgrpo.base.config import ConfigError, EmbeddedEngineConfig, build_config, describe
from asyncgrpo.base.config.engine import EXPERIMENTAL_CUDA_ENV


@pytest.fixture(autouse=True)
def without_the_gate(monkeypatch):
    monkeypatch.delenv(EXPERIMENTAL_CUDA_ENV, raising=False)


def test_auto_and_cpu_resolve_to_the_cpu_and_its_slot_cache():
    assert build_config({}).engine.device == "auto"
    for device in ("auto", "cpu"):
        engine = build_config({"engine": {"device": device}}).engine
        assert engine.resolved_device() == "cpu"
        assert engine.resolved_kv_cache() == "slots"
    paged = EmbeddedEngineConfig(kv_cache="paged")
    assert paged.resolved_kv_cache() == "paged" and paged.resolved_paged_attention() == "gather"
    flex = EmbeddedEngineConfig(kv_cache="paged", paged_attention="flex")
    assert flex.resolved_paged_attention() == "flex"


def test_cuda_is_refused_saying_what_exists_and_what_is_missing():
    with pytest.raises(ConfigError) as refused:
        build_config({}, ["engine.device=cuda"])
    message = str(refused.value)
    assert "'engine.device': cuda is not available in the embedded engine yet" in message
    assert "paged KV cache with block tables" in message  # what exists
    assert "nothing has run or been measured on a GPU" in message  # what is missing
    assert "engine.type: vllm" in message  # what to do instead
    assert f"{EXPERIMENTAL_CUDA_ENV}=1 lets it through" in message  # the gate
    with pytest.raises(ValueError, match="not available in the embedded engine yet"):
        EmbeddedEngineConfig(device="cuda")
    args = cli.build_parser().parse_args(["serve", "--device", "cuda"])
    with pytest.raises(cli.CliError, match="'device': cuda is not available"):
        cli.engine_config(args)


def test_the_gate_lets_cuda_through_on_a_paged_cache_with_flex_attention(monkeypatch):
    monkeypatch.setenv(EXPERIMENTAL_CUDA_ENV, "0")
    with pytest.raises(ValueError, match="not available in the embedded engine yet"):
        EmbeddedEngineConfig(device="cuda")
    monkeypatch.setenv(EXPERIMENTAL_CUDA_ENV, "1")
    engine = build_config({}, ["engine.device=cuda"]).engine
    assert engine.resolved_device() == "cuda"
    assert engine.resolved_kv_cache() == "paged"
    assert engine.resolved_paged_attention() == "flex"
    assert engine.resolved_compute_dtype() == engine.resolved_dtype()
    gathered = EmbeddedEngineConfig(device="cuda", paged_attention="gather", dtype="float32")
    assert gathered.resolved_paged_attention() == "gather"
    with pytest.raises(ValueError, match="kv_cache slots with device cuda"):
        EmbeddedEngineConfig(device="cuda", kv_cache="slots")
    args = cli.build_parser().parse_args(["serve", "--device", "cuda", "--kv-cache", "paged"])
    assert cli.engine_config(args).resolved_device() == "cuda"


def test_a_paged_attention_without_a_paged_cache_is_refused():
    with pytest.raises(ValueError, match="paged_attention flex attends a paged KV cache"):
        EmbeddedEngineConfig(paged_attention="flex")
    with pytest.raises(ValueError, match="paged_attention gather attends a paged KV cache"):
        EmbeddedEngineConfig(kv_cache="slots", paged_attention="gather")


def test_the_device_has_its_help_config_line():
    lines = [line for line in describe() if line.startswith("engine.device = ")]
    assert len(lines) == 1
    assert lines[0].startswith("engine.device = 'auto'  # Where the embedded engine keeps")
    assert "CUDA device once the engine's CUDA path is measured" in lines[0]
    assert EXPERIMENTAL_CUDA_ENV in lines[0]


def test_a_flat_device_must_say_which_section():
    # trainer.device and engine.device share the leaf name, so a flat `device` is ambiguous
    with pytest.raises(ConfigError, match="several sections, give one: engine.device, trainer"):
        build_config({"device": "cpu"})
    assert build_config({"trainer": {"device": "cpu"}}).trainer.device == "cpu"

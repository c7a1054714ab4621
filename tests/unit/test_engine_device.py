"""`engine.device`: the CPU today, and `cuda` refused with what exists and what is missing."""

from __future__ import annotations

import pytest

from asyncgrpo import cli
from asyncgrpo.base.config import ConfigError, EmbeddedEngineConfig, build_config, describe


def test_auto_and_cpu_resolve_to_the_cpu():
    assert build_config({}).engine.device == "auto"
    for device in ("auto", "cpu"):
        engine = build_config({"engine": {"device": device}}).engine
        assert engine.resolved_device() == "cpu"


def test_cuda_is_refused_saying_what_exists_and_what_is_missing():
    with pytest.raises(ConfigError) as refused:
        build_config({}, ["engine.device=cuda"])
    message = str(refused.value)
    assert "'engine.device': cuda is not available in the embedded engine yet" in message
    assert "paged KV cache with block tables" in message  # what exists
    assert "nothing has run or been measured on a GPU" in message  # what is missing
    assert "engine.type: vllm" in message  # what to do instead
    with pytest.raises(ValueError, match="not available in the embedded engine yet"):
        EmbeddedEngineConfig(device="cuda")
    args = cli.build_parser().parse_args(["serve", "--device", "cuda"])
    with pytest.raises(cli.CliError, match="'device': cuda is not available"):
        cli.engine_config(args)


def test_the_device_has_its_help_config_line():
    lines = [line for line in describe() if line.startswith("engine.device = ")]
    assert len(lines) == 1
    assert lines[0].startswith("engine.device = 'auto'  # Where the embedded engine keeps")
    assert "CUDA device once the engine's CUDA path is measured" in lines[0]


def test_a_flat_device_must_say_which_section():
    # trainer.device and engine.device share the leaf name, so a flat `device` is ambiguous
    with pytest.raises(ConfigError, match="several sections, give one: engine.device, trainer"):
        build_config({"device": "cpu"})
    assert build_config({"trainer": {"device": "cpu"}}).trainer.device == "cpu"

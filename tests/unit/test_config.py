"""Config loading: typed sections, overrides, and errors that name the field."""

import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.base.config import ConfigError, RunConfig, build_config, describe, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: demo\nrollout:\n  num_generations: 4\n")
    cfg = load_config(
        path, ["coordinator.max_staleness=0", "loss.epsilon_high=0.3", "report_to=[]"]
    )
    assert cfg.name == "demo" and cfg.rollout.num_generations == 4
    assert cfg.coordinator.max_staleness == 0 and cfg.loss.epsilon_high == 0.3
    assert isinstance(cfg, RunConfig)


def test_unknown_key_suggests_closest_name():
    with pytest.raises(
        ConfigError, match=r"unknown key 'rollout.num_generaton'; did you mean 'num_generations'"
    ):
        build_config({"rollout": {"num_generaton": 4}})
    with pytest.raises(ConfigError, match=r"unknown key 'max_step'; did you mean 'max_steps'"):
        build_config({}, ["max_step=3"])


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError, match=r"'coordinator.max_staleness'"):
        build_config({"coordinator": {"max_staleness": "lots"}})
    with pytest.raises(ConfigError, match=r"'rollout.num_generations'"):
        build_config({"rollout": {"num_generations": 1}})  # a group needs two samples


def test_bad_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_every_field_is_documented():
    lines = describe()
    assert len(lines) > 30
    undocumented = [line for line in lines if line.endswith("# ")]
    assert undocumented == []


def test_validating_a_recipe_imports_neither_torch_nor_the_trainer():
    """Config is the bottom layer: a fresh process checks every recipe (and each loss name)
    without loading torch, transformers or any of the trainer."""
    recipes = sorted(str(p) for p in (Path(__file__).parents[2] / "recipes").glob("*.yaml"))
    script = f"""
import sys
from asyncgrpo.base.config import load_config
for recipe in {recipes!r}:
    for loss in ("clipped", "cispo", "decoupled_ppo"):
        load_config(recipe, [f"loss.name={{loss}}"])
heavy = ("torch", "transformers", "asyncgrpo.learning.trainer")
print(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m.startswith(heavy)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(recipes) >= 3
    assert out.stdout.strip() == "[]"


def test_auto_engine_dtype_follows_the_hardware(monkeypatch):
    import torch

    from asyncgrpo.base import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    assert load_config(None, []).engine.resolved_dtype() == "float32"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    assert load_config(None, []).engine.resolved_dtype() == "bfloat16"
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert load_config(None, []).engine.resolved_dtype() == "bfloat16"
    explicit = load_config(None, ["engine.dtype=float32"]).engine
    assert explicit.resolved_dtype() == "float32"
    with pytest.raises(ConfigError, match="'model.dtype' moved to 'engine.dtype'"):
        load_config(None, ["model.dtype=float32"])


def test_a_sync_interval_the_staleness_bound_cannot_absorb_is_refused():
    with pytest.raises(ConfigError, match="weight_sync_steps=3 needs max_staleness >= 2"):
        load_config(None, ["coordinator.weight_sync_steps=3", "coordinator.max_staleness=1"])
    cfg = load_config(None, ["coordinator.weight_sync_steps=3", "coordinator.max_staleness=2"])
    assert cfg.coordinator.weight_sync_steps == 3


def test_a_vllm_server_off_loopback_needs_the_explicit_opt_in():
    with pytest.raises(
        ConfigError,
        match=r"vllm_host '0\.0\.0\.0': vLLM's pause and weight-update routes have no "
        r"authentication.*set allow_unauthenticated_vllm: true",
    ):
        build_config({"engine": {"type": "vllm", "vllm_host": "0.0.0.0"}})
    for host in ("127.0.0.1", "localhost", "::1"):
        assert build_config({"engine": {"type": "vllm", "vllm_host": host}})
    opted_in = {"type": "vllm", "vllm_host": "0.0.0.0", "allow_unauthenticated_vllm": True}
    assert build_config({"engine": opted_in}).engine.vllm_host == "0.0.0.0"


def test_replicas_of_one_attached_vllm_server_are_refused():
    attached = {"type": "vllm", "base_url": "http://127.0.0.1:8000"}
    with pytest.raises(
        ConfigError, match=r"replicas 2 with base_url: an attached vLLM server is one replica"
    ):
        build_config({"engine": {**attached, "replicas": 2}})
    assert build_config({"engine": attached}).engine.replicas == 1
    launched = build_config({"engine": {"type": "vllm", "replicas": 2}}).engine
    assert launched.replicas == 2 and launched.base_url is None

"""The engine section is one class per `engine.type`: each takes its own fields only,
refuses another type's with the type it belongs to, and recipes and `--set` keep working."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from asyncgrpo import cli
from asyncgrpo.base.config import (
    ENGINE_TYPES,
    ConfigError,
    EmbeddedEngineConfig,
    ExternalEngineConfig,
    VLLMEngineConfig,
    build_config,
    describe,
    load_config,
    parse_engine_config,
)

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))

OWN_FIELDS = {
    "embedded": {"num_threads": 2, "max_num_seqs": 8, "prefix_cache_tokens": 0, "replicas": 2},
    "external": {"base_url": "http://10.0.0.5:8000", "admin_token_env": "MY_TOKEN"},
    "vllm": {"vllm_python": "/opt/vllm/bin/python", "vllm_args": ["--enforce-eager"]},
}


@pytest.mark.parametrize("engine_type", list(OWN_FIELDS))
def test_each_type_takes_its_own_fields_and_the_shared_ones(engine_type):
    section = {"type": engine_type, "sync_timeout_s": 12.0, **OWN_FIELDS[engine_type]}
    engine = build_config({"engine": section}).engine
    assert type(engine) is ENGINE_TYPES[engine_type]
    for key, value in section.items():
        assert getattr(engine, key) == value, key


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"type": "vllm", "num_threads": 2},
            "'engine.num_threads' applies to engine.type: embedded, and this engine's type is vllm",
        ),
        (
            {"vllm_env": {"CUDA_VISIBLE_DEVICES": "1"}},  # no type: embedded
            "'engine.vllm_env' applies to engine.type: vllm, and this engine's type is embedded",
        ),
        (
            {"type": "external", "base_url": "http://h:1", "replicas": 2},
            "'engine.replicas' applies to engine.type: embedded or vllm",
        ),
        (
            {"type": "embedded", "base_url": "http://h:1"},
            "'engine.base_url' applies to engine.type: external or vllm",
        ),
    ],
)
def test_a_field_of_another_type_is_refused_naming_the_type_it_applies_to(section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({"engine": section})


def test_an_unknown_type_and_a_misspelt_field_say_what_is_valid():
    with pytest.raises(ConfigError, match=r"'engine.type': one of embedded, external, vllm"):
        build_config({"engine": {"type": "sglang"}})
    with pytest.raises(
        ConfigError, match=r"unknown key 'engine.vllm_pyton'; did you mean 'vllm_python'"
    ):
        build_config({"engine": {"type": "vllm", "vllm_pyton": "x"}})


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_recipes_load_unchanged_and_switch_to_vllm_by_override(recipe, caplog):
    data = yaml.safe_load(recipe.read_text())
    written = data.get("engine", {})
    engine = load_config(recipe).engine
    assert isinstance(engine, EmbeddedEngineConfig)
    for key, value in written.items():
        assert getattr(engine, key) == value, key

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.base.config.variants"):
        switched = load_config(recipe, ["engine.type=vllm", "engine.vllm_python=/x/python"])
    assert isinstance(switched.engine, VLLMEngineConfig)
    assert switched.engine.vllm_python == "/x/python"
    left_out = [key for key in written if key not in VLLMEngineConfig.model_fields]
    for key in written:
        if key not in left_out:
            assert getattr(switched.engine, key) == written[key], key
    for key in left_out:  # said, not silently dropped
        assert f"engine.{key}" in caplog.text


def test_set_takes_the_type_in_any_order_but_refuses_another_types_field_it_gives():
    for overrides in (
        ["engine.type=vllm", "engine.vllm_args=[--enforce-eager]"],
        ["engine.vllm_args=[--enforce-eager]", "engine.type=vllm"],  # type set last
    ):
        engine = load_config(None, overrides).engine
        assert isinstance(engine, VLLMEngineConfig) and engine.vllm_args == ["--enforce-eager"]
    with pytest.raises(ConfigError, match="'engine.num_threads' applies to engine.type: embedded"):
        load_config(None, ["engine.num_threads=2", "engine.type=vllm"])
    written_together = {"engine": {"type": "vllm", "max_num_seqs": 8}}  # one file: refused
    with pytest.raises(ConfigError, match="'engine.max_num_seqs' applies to engine.type: embedded"):
        build_config(written_together)


def test_flat_and_trl_names_reach_the_variant_that_has_them():
    vllm = build_config({"use_vllm": True, "vllm_python": "/x/python"}).engine
    assert isinstance(vllm, VLLMEngineConfig) and vllm.vllm_python == "/x/python"
    assert build_config({"max_num_seqs": 8}).engine.max_num_seqs == 8
    with pytest.raises(ConfigError, match="'engine.max_num_seqs' applies to engine.type: embedded"):
        build_config({"use_vllm": True, "max_num_seqs": 8})


def test_help_config_lists_every_field_of_every_type_grouped_by_type():
    lines = describe()
    names = [line.split(" = ")[0] for line in lines if not line.startswith("#")]
    for cls in ENGINE_TYPES.values():
        for field in cls.model_fields:
            assert names.count(f"engine.{field}") == 1, field
    assert "# engine.type: vllm only" in lines
    vllm_only = lines.index("# engine.type: vllm only")
    assert lines[vllm_only + 1].startswith("engine.vllm_python = None  # ")
    assert all(not line.endswith("# ") for line in lines)


def test_serve_validates_the_embedded_engine_and_refuses_other_types_fields(tmp_path):
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("max_num_seqs: 3\nvllm_host: 0.0.0.0\n")
    args = cli.build_parser().parse_args(["serve", "--config", str(config_file)])
    with pytest.raises(cli.CliError, match="'vllm_host' applies to engine.type: vllm"):
        cli.engine_config(args)


def test_a_section_travels_as_json_and_comes_back_as_its_own_type():
    for cfg in (
        EmbeddedEngineConfig(model="m", num_threads=3),
        ExternalEngineConfig(base_url="http://h:1"),
        VLLMEngineConfig(model="m", vllm_args=["--enforce-eager"]),
    ):
        assert parse_engine_config(cfg.model_dump_json()) == cfg
        assert parse_engine_config(cfg.model_dump()) == cfg


def test_the_run_completes_the_section_for_the_types_that_load_a_model():
    assert EmbeddedEngineConfig().for_run("/models/m", 8).model == "/models/m"
    assert EmbeddedEngineConfig(model="/mine").for_run("/models/m", None).model == "/mine"
    vllm = VLLMEngineConfig().for_run("/models/m", 8)
    assert (vllm.model, vllm.max_lora_rank) == ("/models/m", 8)
    assert VLLMEngineConfig(max_lora_rank=16).for_run("/m", 8).max_lora_rank == 16
    external = ExternalEngineConfig(base_url="http://h:1")
    assert external.for_run("/models/m", 8) == external  # its server loads its own model


def test_the_episode_gateway_gets_the_vllm_sections_server_settings():
    vllm = VLLMEngineConfig(
        model="/m",
        replicas=2,
        max_model_len=512,
        served_model_name="policy",
        tool_parser="hermes",
        max_open_episodes=7,
        weight_transport="disk",
    )
    gateway = vllm.gateway_config("http://127.0.0.1:9000")
    assert isinstance(gateway, EmbeddedEngineConfig)
    assert gateway.upstream_url == "http://127.0.0.1:9000"
    assert (gateway.model, gateway.max_model_len, gateway.served_model_name) == (
        "/m",
        512,
        "policy",
    )
    assert gateway.max_open_episodes == 7
    assert (gateway.replicas, gateway.weight_transport) == (1, "shm")  # it holds no weights


def whole_old_section(**given) -> dict:
    """An `engine:` section as a `config.yaml` written before the split lists it: every
    field of every type, at its default unless given."""
    section = {}
    for cls in ENGINE_TYPES.values():
        for name, field in cls.model_fields.items():
            section.setdefault(name, field.get_default(call_default_factory=True))
    section.pop("type")
    return {**section, **given}


@pytest.mark.parametrize(
    ("given", "cls"),
    [
        ({"num_threads": 2, "max_model_len": 256}, EmbeddedEngineConfig),
        ({"type": "vllm", "vllm_python": "/x/python", "max_model_len": 256}, VLLMEngineConfig),
        ({"type": "external", "base_url": "http://h:1"}, ExternalEngineConfig),
    ],
)
def test_a_run_directorys_older_config_with_every_engine_field_still_loads(tmp_path, given, cls):
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"engine": whole_old_section(**given)}))
    engine = load_config(saved).engine
    assert type(engine) is cls
    for key, value in given.items():
        assert getattr(engine, key) == value, key
    # a value that says something is still refused
    with pytest.raises(ConfigError, match="'engine.vllm_host' applies to engine.type: vllm"):
        build_config({"engine": whole_old_section(vllm_host="10.0.0.1", num_threads=2)})

"""A recipe's `engine:` section reaches the engine process exactly as written.

The embedded engine is `asyncgrpo serve` in a child process that receives the
`EmbeddedEngineConfig` as JSON; this starts one on the tiny model with values that differ
from every default and reads them back from `GET /server_info`. It also checks that
`asyncgrpo serve` offers a flag for every server-side `EmbeddedEngineConfig` field, so the
command line and a recipe configure the same settings.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from asyncgrpo import cli
from asyncgrpo.base.config import EmbeddedEngineConfig, build_config
from asyncgrpo.inference.engine.process import EngineProcess

RECIPE_ENGINE = {
    "max_model_len": 200,
    "max_num_seqs": 3,
    "dtype": "float32",
    "prefix_cache_tokens": 0,
    "prefill_chunk_size": 64,
    "served_model_name": "recipe-name",
    "num_threads": 1,
}


def test_recipe_values_differ_from_the_defaults():
    defaults = EmbeddedEngineConfig()
    for key, value in RECIPE_ENGINE.items():
        if key != "num_threads":  # one thread is the default and what a 2-core test wants
            assert getattr(defaults, key) != value, key


@pytest.fixture(scope="module")
def recipe_engine(tiny_model_dir):
    """`asyncgrpo serve` on the tiny model, configured by the recipe's `engine:` section."""
    cfg = build_config({"engine": RECIPE_ENGINE})
    engine_cfg = cfg.engine.model_copy(update={"model": str(tiny_model_dir)})
    proc = EngineProcess(engine_cfg)
    proc.start()
    try:
        proc.wait_ready(120)
        yield proc, engine_cfg
    finally:
        proc.stop()


def test_server_info_reports_the_recipes_engine_settings(recipe_engine, tiny_model_dir):
    proc, engine_cfg = recipe_engine
    response = httpx.get(
        f"{proc.base_url}/server_info",
        headers={"Authorization": f"Bearer {proc.admin_token}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    info = response.json()

    assert info["max_model_len"] == 200
    assert info["max_num_seqs"] == 3
    assert info["dtype"] == "float32"
    assert info["model"] == "recipe-name"  # the served name, not the path
    assert Path(info["model_path"]) == Path(tiny_model_dir)

    running = info["engine_config"]
    for key, value in RECIPE_ENGINE.items():
        assert running[key] == value, key
    assert Path(running["model"]) == Path(tiny_model_dir)
    # nothing else drifted either: the engine runs with the recipe's config, field for field
    expected = engine_cfg.model_dump()
    expected["model"] = running["model"]  # the path as `serve` resolved it
    assert running == expected


def test_engine_enforces_the_recipes_context_limit_and_name(recipe_engine):
    proc, _ = recipe_engine
    models = httpx.get(f"{proc.base_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["recipe-name"]
    too_long = httpx.post(
        f"{proc.base_url}/v1/completions",
        json={"model": "recipe-name", "prompt": [5] * 200, "max_tokens": 1},
        timeout=10,
    )
    assert too_long.status_code == 400 and "max_model_len" in too_long.text


def test_server_info_refuses_a_request_without_the_admin_token(recipe_engine):
    proc, _ = recipe_engine
    response = httpx.get(f"{proc.base_url}/server_info", timeout=10)
    assert response.status_code == 401


def serve_flags() -> set[str]:
    parser = cli.build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    serve = subparsers.choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings}


@pytest.mark.parametrize(
    "name", [n for n in EmbeddedEngineConfig.model_fields if n not in cli.CLIENT_SIDE]
)
def test_serve_has_a_flag_for_every_server_side_engine_field(name):
    assert f"--{name.replace('_', '-')}" in serve_flags()


def test_serve_flags_override_the_config_file_and_validate_as_engine_config(tmp_path):
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("max_num_seqs: 3\nmax_model_len: 200\n")
    args = cli.build_parser().parse_args(
        ["serve", "--config", str(config_file), "--max-num-seqs", "5", "--dtype", "float32"]
    )
    cfg = cli.engine_config(args)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.dtype) == (5, 200, "float32")


def test_client_side_fields_are_not_serve_flags():
    flags = serve_flags()
    for name in cli.CLIENT_SIDE:
        assert name in EmbeddedEngineConfig.model_fields
        assert f"--{name.replace('_', '-')}" not in flags

"""`asyncgrpo --help` says what the tool does; `asyncgrpo serve --help` documents every flag
with its default, including the ones generated from `EmbeddedEngineConfig` fields."""

from __future__ import annotations

import argparse

import pytest

from asyncgrpo import cli
from asyncgrpo.base.config import EmbeddedEngineConfig


def subparser(name: str) -> argparse.ArgumentParser:
    commands = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return commands.choices[name]


def serve_options() -> list[argparse.Action]:
    return [a for a in subparser("serve")._actions if not isinstance(a, argparse._HelpAction)]


def test_top_level_help_says_what_the_tool_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "asynchronous GRPO" in text
    for command, purpose in [
        ("train", "train a model from a recipe"),
        ("serve", "serve a model"),
        ("export", "model directory that transformers loads"),
    ]:
        assert command in text and purpose in text, purpose
    assert "thin argument parsing" not in text  # the developer's docstring stays out


@pytest.mark.parametrize("action", serve_options(), ids=lambda a: a.option_strings[0])
def test_every_serve_flag_has_help_and_shows_its_default(action):
    assert action.help and len(action.help) > 20
    assert "(default: " in action.help
    assert "PydanticUndefined" not in action.help


def test_serve_help_renders_every_engine_field_with_its_docstring_and_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, field in EmbeddedEngineConfig.model_fields.items():
        if name in cli.CLIENT_SIDE:
            continue
        assert f"--{name.replace('_', '-')}" in text, name
        if name != "model":  # serve words its own
            first_words = " ".join(field.description.split()[:4])
            assert first_words in text, name
    assert "(default: 64)" in text  # max_num_seqs
    assert "max_position_embeddings" in text  # what max_model_len defaults to


def test_serve_model_flag_names_checkpoints_and_the_real_default():
    (model,) = [a for a in serve_options() if a.option_strings == ["--model"]]
    assert "RUN_DIR/checkpoints/step-N" in model.help
    assert "(default: smollm2-135m)" in model.help


def test_run_side_engine_fields_are_not_serve_flags():
    flags = {s for a in serve_options() for s in a.option_strings}
    for gone in ("--replicas", "--vllm-args", "--vllm-host", "--allow-unauthenticated-vllm"):
        assert gone not in flags


def test_plot_is_a_command(capsys):
    """`asyncgrpo plot` reaches the plotting entry point (its docstrings promise it)."""
    from asyncgrpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plot", "--help"])
    assert exit_info.value.code == 0
    assert "Draw PNG plots from run directories" in capsys.readouterr().out

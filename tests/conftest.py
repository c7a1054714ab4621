"""Shared fixtures: a tiny random Llama model directory built once per session."""

import pytest

from asyncgrpo.testing import save_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))

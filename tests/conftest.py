"""Shared fixtures: a tiny random Llama model directory built once per session, and an
embedded engine process serving it (settings per test module: `ENGINE_SETTINGS`)."""

import pytest

from asyncgrpo.config import EmbeddedEngineConfig
from asyncgrpo.engine.process import EngineProcess
from asyncgrpo.testing import save_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, request):
    """`asyncgrpo serve` on the tiny model, fp32, one thread, plus the module's
    `ENGINE_SETTINGS` (any `EmbeddedEngineConfig` field)."""
    settings = dict(dtype="float32", num_threads=1)
    settings.update(getattr(request.module, "ENGINE_SETTINGS", {}))
    proc = EngineProcess(EmbeddedEngineConfig(model=str(tiny_model_dir), **settings))
    proc.start()
    try:
        proc.wait_ready(120)
        yield proc
    finally:
        proc.stop()

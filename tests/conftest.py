"""Shared fixtures: a tiny random Llama model directory built once per session, and an
embedded engine process serving it (settings per test module: `ENGINE_SETTINGS`).

A module that only reads from its server (no weight syncs, no restarts, nothing left
paused) sets `SHARED_ENGINE = True`: modules with equal settings then share one server,
started for the first of them and stopped after the last, instead of paying an engine
start (about 5 s of CPU) each."""

import pytest

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.testing import save_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def start_server(model_dir, settings: dict) -> EngineProcess:
    proc = EngineProcess(EmbeddedEngineConfig(model=str(model_dir), **settings))
    proc.start()
    try:
        proc.wait_ready(120)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="session")
def shared_servers():
    """Servers of the `SHARED_ENGINE` modules by their settings; each is stopped after the
    last module that uses it (tests that count engine processes come later), any left at
    the end of the session then."""
    servers: dict[tuple, EngineProcess] = {}
    yield servers
    for proc in servers.values():
        proc.stop()


def server_settings(module) -> dict:
    settings = dict(dtype="float32", num_threads=1)
    settings.update(getattr(module, "ENGINE_SETTINGS", {}))
    return settings


def shared_key(module) -> tuple | None:
    """What a module's `server` is shared by, or None for a server of its own."""
    if not getattr(module, "SHARED_ENGINE", False):
        return None
    return tuple(sorted(server_settings(module).items()))


def used_later(session, module, key: tuple) -> bool:
    """Whether a test after this module's last one takes a shared server of these settings."""
    items = session.items
    last = max(i for i, item in enumerate(items) if getattr(item, "module", None) is module)
    return any(
        "server" in getattr(item, "fixturenames", ()) and shared_key(item.module) == key
        for item in items[last + 1 :]
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir, request, shared_servers):
    """`asyncgrpo serve` on the tiny model, fp32, one thread, plus the module's
    `ENGINE_SETTINGS` (any `EmbeddedEngineConfig` field)."""
    settings = server_settings(request.module)
    key = shared_key(request.module)
    if key is None:
        proc = start_server(tiny_model_dir, settings)
    elif key in shared_servers:
        proc = shared_servers[key]
    else:
        proc = shared_servers[key] = start_server(tiny_model_dir, settings)
    try:
        yield proc
    finally:
        if key is None or not used_later(request.session, request.module, key):
            shared_servers.pop(key, None)
            proc.stop()

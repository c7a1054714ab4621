"""Fixtures of the fuzz suite: one real `asyncgrpo serve` on the tiny model, and its fuzzer.

The server is the `server` fixture of tests/conftest.py, started with its
address space capped (`SERVER_ADDRESS_SPACE`): a request that makes it allocate
without bound fails inside the server (a finding) instead of pushing the machine
into the kernel's OOM killer. The tiny model's 512-token context and 8 batch
slots bound what any one generation request can cost, whatever `max_tokens` the
fuzzer picks.

The fuzzer measures the server before any case (greedy answer, resident memory)
after a warm-up, so lazily built state is not counted as growth.
"""

from __future__ import annotations

import resource
from contextlib import contextmanager

import pytest
from fuzz_http import Fuzzer

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.process import EngineProcess

GiB = 2**30
SERVER_ADDRESS_SPACE = 6 * GiB  # the tiny-model server maps about 1.1 GiB
FUZZ_ENGINE_SETTINGS = dict(
    dtype="float32", num_threads=1, max_num_seqs=8, max_model_len=512, served_model_name="tiny"
)


@contextmanager
def address_space_limit(limit: int):
    """Lower this process's soft RLIMIT_AS for the duration (children started inside keep it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    capped = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (capped, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class CappedEngineProcess(EngineProcess):
    """An engine process whose every (re)start runs under the address-space cap."""

    def start(self) -> None:
        with address_space_limit(SERVER_ADDRESS_SPACE):
            super().start()


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    proc = CappedEngineProcess(
        EmbeddedEngineConfig(model=str(tiny_model_dir), **FUZZ_ENGINE_SETTINGS)
    )
    proc.start()
    try:
        proc.wait_ready(120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def fuzzer(fuzz_server):
    fuzzer = Fuzzer(fuzz_server, restart=lambda: fuzz_server.restart(120))
    warm_up(fuzzer)
    fuzzer.take_baseline()
    yield fuzzer
    fuzzer.close()


def warm_up(fuzzer: Fuzzer) -> None:
    """Ordinary traffic on every generation path, so first-use allocations precede the baseline."""
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    completion = {"prompt": "Hello, world", "max_tokens": 4, "n": 4, "logprobs": 2}
    for stream in (False, True):
        fuzzer.control.post(
            "/v1/chat/completions", json=chat | {"stream": stream}
        ).raise_for_status()
        fuzzer.control.post(
            "/v1/completions", json=completion | {"stream": stream}
        ).raise_for_status()
    episode = fuzzer.open_episode()
    fuzzer.control.post(
        f"/e/{episode['episode_id']}/v1/chat/completions",
        json=chat,
        headers={"authorization": f"Bearer {episode['api_key']}"},
    ).raise_for_status()
    fuzzer.close_episode(episode["episode_id"])

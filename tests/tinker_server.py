"""`asyncgrpo tinker-serve` for tests: its app over `build_service`, under uvicorn on a
thread of the test process (the engine is its own process, as in the real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch
import uvicorn

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.ports import free_port

API_KEY = "tml-asyncgrpo-test-key"


@contextmanager
def serve_tinker(model_dir: Path, state_dir: Path, dtype: str = "float32") -> Iterator[str]:
    """The server's base URL while the block runs."""
    with running_tinker(model_dir, state_dir, dtype) as (url, _):
        yield url


@contextmanager
def running_tinker(
    model_dir: Path,
    state_dir: Path,
    dtype: str = "float32",
    engine=None,
    start_timeout: float = 120,
    **build_args,
) -> Iterator[tuple[str, object]]:
    """The server's base URL and its `TinkerService` (for tests that look inside it) while
    the block runs; `engine`: what samples (default: the embedded engine in `dtype`), given
    `start_timeout` seconds to start; `build_args` go to `build_service` (e.g.
    `session_ttl_s`)."""
    from asyncgrpo.tinker.app import create_app
    from asyncgrpo.tinker.build import build_service

    engine = engine or EmbeddedEngineConfig(model=str(model_dir), dtype=dtype, num_threads=1)
    service = build_service(str(model_dir), model_dir, engine, state_dir, **build_args)
    port = free_port()
    config = uvicorn.Config(
        create_app(service, API_KEY), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="tinker-serve", daemon=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tinker-serve's --trainer-threads default, beside the engine's 1
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, thread, start_timeout)
        yield url, service
    finally:
        server.should_exit = True
        thread.join(60)
        torch.set_num_threads(threads)


def _wait_healthy(url: str, thread: threading.Thread, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the tinker server stopped while starting (see the log above)")
        try:  # uvicorn answers once the app's startup (the engine ready) is done
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("tinker-serve did not start")


def datum(tokens: list[int], **inputs):
    """A `tinker.types.Datum` whose position i predicts tokens[i + 1] (the SDK's shift)."""
    from tinker import types

    loss_inputs = {"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:]))}
    for name, values in inputs.items():
        loss_inputs[name] = types.TensorData.from_numpy(np.asarray(values, dtype=np.float32))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_inputs
    )

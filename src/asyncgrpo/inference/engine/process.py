"""Run the embedded engine as a child process (`asyncgrpo serve`) and keep it alive.

The engine gets its own process so its torch threads never contend with the
trainer's inside one interpreter, and so a crash in it cannot take the trainer
down. This class owns that child: a free loopback port, a fresh admin token
(passed through the environment, never on the command line where `ps` shows it),
the log file, readiness polling, restart, and reaping on exit. A child that dies
before it is ready is explained by its own last words from the log (`last_words`),
so the user sees why, not only an exit code.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.engine_errors import EngineStartError
from asyncgrpo.base.ports import free_port

PARENT_PID_ENV = "ASYNCGRPO_PARENT_PID"


def exit_with_parent(period: float = 1.0) -> None:
    """In the child: exit when the process that started us is gone.

    The engine runs in its own session (so a terminal's Ctrl-C reaches only the
    trainer, which then stops it cleanly); without this watch a trainer killed
    with SIGKILL would leave an orphaned engine holding its cores forever.
    """
    import threading

    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(period)
        os._exit(0)

    threading.Thread(target=watch, name="asyncgrpo-parent-watch", daemon=True).start()


def last_words(output: str, max_lines: int = 5) -> str:
    """The lines of a dead child's output that say why it died.

    `asyncgrpo serve` reports a problem it recognises as one `error: ...` line; anything
    else ends in a traceback whose last line is the exception. Lines are joined with
    " | " so the cause fits a one-line message.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1].removeprefix("error:").strip()
    if "Traceback (most recent call last):" in lines:
        return lines[-1]
    return " | ".join(line[:300] for line in lines[-max_lines:])


class StartGuard:
    """Refuses to start a child once its owner closed: a restart running in another
    thread (a replica's, in the background) must not start one after the run's close
    stopped it, or the child outlives the run."""

    def __init__(self, error: type[Exception]):
        self._error = error
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def starting(self, what: str) -> Iterator[None]:
        """Hold while the child is started: `close` waits for it, or it refuses."""
        with self._lock:
            if self._closed:
                raise self._error(f"{what} was not started: it was closed for good")
            yield

    def close(self) -> None:
        with self._lock:
            self._closed = True


class EngineProcess:
    """A supervised `asyncgrpo serve` child process bound to 127.0.0.1.

    The child receives `config` as one JSON file and validates it with the same
    `EmbeddedEngineConfig` model, so a recipe's engine settings arrive exactly as written.
    `host`: another address to bind, for an engine a trainer on another node reaches
    (`cluster.launcher: ray`); its control routes still need `admin_token`.
    """

    def __init__(
        self,
        config: EmbeddedEngineConfig,
        *,
        log_path: str | Path | None = None,
        host: str = "127.0.0.1",
        admin_token: str | None = None,
    ):
        if config.model is None:
            raise EngineStartError("engine.model: no model directory given")
        self.config = config
        self.log_path = Path(log_path) if log_path else None
        self.host = host
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        self.port = 0
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._log_start = 0  # where this start's output begins in the (appended) log
        self._config_file: str | None = None
        self._guard = StartGuard(EngineStartError)
        self.extra_env: dict[str, str] = {}  # more environment for the child (core_share.py)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The running child's process id (its descriptors are in /proc/<pid>/fd)."""
        return self._proc.pid if self.alive() else None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "asyncgrpo.cli",
            "serve",
            "--config",
            self._config_file,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def _write_config(self) -> None:
        """The config file the child reads (removed again by `stop`)."""
        fd, self._config_file = tempfile.mkstemp(prefix="asyncgrpo-engine-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(self.config.model_dump_json())

    def start(self) -> None:
        with self._guard.starting("the engine process"):
            self._start()

    def _start(self) -> None:
        if self.alive():
            return
        if self.port == 0:  # keep the address across restarts
            self.port = free_port(self.host)
        self._write_config()
        env = dict(
            os.environ,
            ASYNCGRPO_ADMIN_TOKEN=self.admin_token,
            **{PARENT_PID_ENV: str(os.getpid())},
            **self.extra_env,
        )
        if self.config.num_threads:
            env["OMP_NUM_THREADS"] = str(self.config.num_threads)
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a+b")
            self._log_start = self._log.tell()
        else:  # unnamed, so that a failed start can still be explained from the output
            self._log = tempfile.TemporaryFile()
            self._log_start = 0
        self._proc = subprocess.Popen(
            self.command(),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll /health until the server answers; fail fast if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineStartError(self._start_failure())
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise EngineStartError(f"engine not ready within {timeout:.0f}s")

    def _start_failure(self) -> str:
        """Why the child died before becoming ready: its exit code and its last words."""
        code = self._proc.returncode if self._proc else None
        message = f"engine process exited with code {code} before becoming ready"
        cause = last_words(self._read_log_tail()) if self._log is not None else ""
        if cause:
            message += f": {cause}"
        return message + (f" (full log: {self.log_path})" if self.log_path else "")

    def _read_log_tail(self, max_bytes: int = 65536) -> str:
        """The end of this start's output (pread: the child shares the file offset)."""
        fd = self._log.fileno()
        size = os.fstat(fd).st_size
        start = max(self._log_start, size - max_bytes)
        return os.pread(fd, size - start, start).decode(errors="replace")

    def restart(self, timeout: float = 300.0) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()  # not left running half-started
            raise

    def close(self) -> None:
        """Stop the child for good: a restart in another thread cannot start it again."""
        self._guard.close()
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after `timeout`) and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        if proc is not None:
            proc.poll()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._config_file is not None:
            Path(self._config_file).unlink(missing_ok=True)
            self._config_file = None

    def kill(self) -> None:
        """SIGKILL the child without cleanup (for fault-injection tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

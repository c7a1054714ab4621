"""Serving an OpenEnv app for a run: `agent.openenv.app: module:app` under uvicorn.

The app runs in a child process (uvicorn on 127.0.0.1 at a free port), not in the
trainer's process: an environment's blocking `step` then never stalls the rollout loop,
and a crash of the environment is a dropped connection (an infra_error), not a crash of
the run. The module is found like `python -m` finds one, from the working directory
(`examples.openenv_guess:app` from the repository root).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from asyncgrpo.base.config import ConfigError
from asyncgrpo.base.ports import free_port

logger = logging.getLogger(__name__)


class ServedApp:
    """An OpenEnv app served by uvicorn in a child process; `stop()` ends it."""

    def __init__(self, app: str, startup_timeout_s: float = 60.0, app_dir: str | None = None):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()  # the child's output, read back if it fails
        cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
        cmd += [
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--app-dir",
            app_dir or os.getcwd(),
        ]
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("serving the OpenEnv app %s at %s", app, self.url)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigError(
                    f"agent.openenv.app: {self.app!r} exited with code "
                    f"{self.process.returncode} before serving:\n{self.output_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise ConfigError(
            f"agent.openenv.app: {self.app!r} did not answer {self.url}/health within "
            f"{timeout_s:g} s (agent.openenv.startup_timeout_s):\n{self.output_tail()}"
        )

    def output_tail(self, chars: int = 3000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:].strip() or "(no output)"

    def stop(self) -> None:
        """Stop the server (its whole process group); safe to call twice."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

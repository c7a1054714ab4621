"""`asyncgrpo tinker-serve` as its own process, started from its command line, for tests
that kill it (SIGKILL, as an out-of-memory kill or a lost host would) and start it again
on the same port and state directory, as an operator would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from asyncgrpo.base.ports import free_port

API_KEY = "tml-asyncgrpo-process-test"


class TinkerProcess:
    """One server address and state directory; a process behind it at a time."""

    def __init__(self, model_dir: Path, state_dir: Path, log_dir: Path, *extra_args: str):
        self.model_dir, self.state_dir, self.log_dir = model_dir, state_dir, log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.log_dir / f"tinker-serve-{self.starts}.log"

    def start(self, timeout: float = 300) -> None:
        """Start a process and wait until it answers its health check."""
        self.starts += 1
        command = [sys.executable, "-m", "asyncgrpo.cli", "tinker-serve"]
        command += ["--model", str(self.model_dir), "--state-dir", str(self.state_dir)]
        command += ["--port", str(self.port), "--dtype", "float32", *self.extra_args]
        env = dict(os.environ, ASYNCGRPO_TINKER_API_KEY=API_KEY)
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tinker-serve exited while starting:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"tinker-serve did not start:\n{self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL: nothing of the process runs after it (its engine exits with it)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()

    def metric(self, name: str, timeout: float = 5) -> float:
        """The sum of a `GET /metrics` family's samples (0 when it has none)."""
        text = httpx.get(f"{self.url}/metrics", timeout=timeout).text
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        ]
        return sum(values)

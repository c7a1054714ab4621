"""`engine.type: embedded`: the built-in engine as a supervised child process.

The process (`engine/process.py`) gets the engine section of the recipe as its
whole configuration. This backend adds what training needs around it: a client
whose retries outlast a restart, the weight transport of `engine.weight_transport`,
and supervision: an engine that dies is restarted on the same port, and a weight
sync that it interrupts is repeated on the new process. An engine that stalls
without dying (a hung process, SIGSTOP) makes the sync miss
`engine.sync_timeout_s`: it is killed, restarted and the sync repeated too.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.engine_errors import EngineDied, EngineRefused, SyncTimeout
from asyncgrpo.inference.backend.base import SYNC_ATTEMPTS, NamedTensors, sync_until_landed
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.client.retry import RetryPolicy
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.inference.transport import make_transport

logger = logging.getLogger(__name__)


class EmbeddedBackend:
    """An `asyncgrpo serve` child process on a loopback port, restarted when it dies."""

    sync_attempts = SYNC_ATTEMPTS  # a sync the engine's death interrupts is repeated

    def __init__(self, cfg: EmbeddedEngineConfig, log_path: Path | None = None, process=None):
        """`process`: what runs the engine, if not a child process here (an engine on a
        Ray node, `cluster.engines.ActorProcess`: it may come back at another address)."""
        self.cfg = cfg
        self.process = process or EngineProcess(cfg, log_path=log_path)
        retry = RetryPolicy(deadline=cfg.startup_timeout_s, max_attempts=1000, max_backoff=2.0)
        # the port is known once launched; the client follows it
        self.client = EngineClient(
            "http://127.0.0.1:0", admin_token=self.process.admin_token, retry=retry
        )
        self.transport = make_transport(
            cfg.weight_transport, self.client, weights_dir=cfg.weights_dir
        )
        self._restart_lock = asyncio.Lock()
        self.sync_timings: dict[str, float] = {}

    @property
    def restarts(self) -> int:
        return self.process.restarts

    @property
    def base_urls(self) -> list[str]:
        return [self.process.base_url]

    def launch(self) -> None:
        self.process.start()  # a no-op when already running
        self.client.base_url = self.process.base_url

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        self.launch()
        if layout is not None:  # lay the first sync's buffers out while the engine loads
            await self.transport.prepare(list(layout))
        await asyncio.to_thread(self.process.wait_ready, self.cfg.startup_timeout_s)
        self.client.base_url = self.process.base_url

    async def healthy(self) -> bool:
        return self.process.alive() and await self.client.health()

    async def revive(self) -> bool:
        async with self._restart_lock:
            if self.process.alive():
                return False
            logger.warning("engine process died; restarting it (restart %d)", self.restarts + 1)
            try:
                await asyncio.to_thread(self.process.restart, self.cfg.startup_timeout_s)
            except Exception as exc:
                raise EngineDied(f"the engine could not be restarted: {exc}") from exc
            self.client.base_url = self.process.base_url
            return True

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        await sync_until_landed(
            self,
            self.transport,
            weights,
            version,
            mode,
            gone=lambda: not self.process.alive(),
            on_stall=self._stalled,
            on_refused=self._refused,
            engine="the engine",
            log=self.process.log_path,
        )

    async def _stalled(self, exc: SyncTimeout) -> None:
        logger.error("%s: killing the engine process to restart it", exc)
        await asyncio.to_thread(self.process.kill)  # SIGKILL works on a stopped one

    async def _refused(self, exc: Exception, attempt: int) -> None:
        if isinstance(exc, EngineRefused):  # a refused update changed nothing: resume
            await self.client.resume()
        raise exc

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.transport.close(), 5)
            await asyncio.wait_for(self.client.aclose(), 5)
        finally:
            await asyncio.to_thread(self.process.close)

"""`engine.type: external`: a server someone else runs (asyncgrpo or vLLM) at `base_url`.

asyncgrpo neither starts nor restarts it: `revive` can only report that it is
gone, and a weight sync that fails or misses `engine.sync_timeout_s` ends the
run with `EngineDied`. Its admin token comes from the environment variable
`admin_token_env`, never from the recipe, which is saved in the run directory.
"""

from __future__ import annotations

import os

from asyncgrpo.base.config import ExternalEngineConfig
from asyncgrpo.base.engine_errors import EngineDied, SyncTimeout
from asyncgrpo.inference.backend.base import NamedTensors, publish
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.client.retry import RetryPolicy
from asyncgrpo.inference.transport import make_transport


class ExternalBackend:
    """A running engine server, reached over HTTP."""

    restarts = 0

    def __init__(self, cfg: ExternalEngineConfig):
        if not cfg.base_url:
            raise ValueError("engine.base_url: required with engine.type external")
        self.cfg = cfg
        retry = RetryPolicy(deadline=cfg.startup_timeout_s, max_attempts=1000, max_backoff=2.0)
        token = os.environ.get(cfg.admin_token_env)
        self.client = EngineClient(cfg.base_url, admin_token=token, retry=retry)
        self.transport = make_transport(
            cfg.weight_transport, self.client, weights_dir=cfg.weights_dir
        )
        self.sync_timings: dict[str, float] = {}

    @property
    def base_urls(self) -> list[str]:
        return [self.client.base_url]

    def launch(self) -> None:
        return None  # already running, or soon: `wait_ready` waits for it

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        await self.client.wait_until_healthy(self.cfg.startup_timeout_s)

    async def healthy(self) -> bool:
        return await self.client.health()

    async def revive(self) -> bool:
        return False  # not ours to restart; the client's retries wait for it to come back

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        try:
            timeout_s = self.cfg.sync_timeout_s
            await publish(
                self.client,
                self.transport,
                weights,
                version,
                mode,
                timeout_s=timeout_s,
                timings=self.sync_timings,
            )
        except SyncTimeout as exc:
            raise EngineDied(
                f"{exc}: the engine at {self.client.base_url} is stalled; it is not ours to "
                "restart (engine.type external)"
            ) from exc
        except Exception as exc:
            raise EngineDied(f"weight sync to {self.client.base_url} failed: {exc}") from exc

    async def close(self) -> None:
        await self.transport.close()
        await self.client.aclose()

"""`engine.type: vllm`: a vLLM server as the engine that samples for the run.

Launched by asyncgrpo (`asyncgrpo.inference.vllm.launcher.VLLMServer`) or, with
`engine.base_url`, attached to; structured like `embedded.py`: a client whose retries
outlast a restart, a weight transport, supervision. Weights travel through the trainer's
existing transports (`shm`, `disk`) into asyncgrpo's worker plugin, or over NCCL
(`asyncgrpo.inference.vllm.nccl`), always inside `publish` (pause, transfer, resume, with the
deadline). The vLLM-specific pieces it drives live in `asyncgrpo.inference.vllm`, which never
imports a backend.

A dead engine is one whose server process exited, refuses connections or answers
/health with 503 (vLLM's API server exits by itself shortly after its engine
core or a worker dies). `revive` restarts it on the same port; the restarted
server holds its initial weights and has forgotten the transfer engine, so the
caller re-sends the weights and the client initialises the transfer again.
Requests in flight when it died get a 500 or a refused connection and are
retried by the client's `RetryPolicy` until the new server answers. An attached
server is never restarted: it is not ours.

With agents (`episodes`), an episode gateway runs beside vLLM: an `asyncgrpo
serve` process fronting it (`engine.upstream_url`), which renders chat
templates, parses tool calls and records exact tokens, calling vLLM token in,
token out. Agents get their episode URLs there; it is started, stopped and
restarted with the vLLM server.

LoRA runs (`engine.max_lora_rank`) publish only the adapter (names in
`asyncgrpo.inference.adapters`). Such a sync goes through `AdapterLoader` instead of the
weight transport: the adapter is written as a peft directory under the run
directory (`engine.weights_dir` when set: an attached server must read it too),
loaded with `/v1/load_lora_adapter` as `asyncgrpo-v{version}` while the server
is paused, and asked for by every later request. vLLM's base weights never
change. Adapters older than the previous one are unloaded, and their files
deleted once no request of ours runs on them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.base.config import ConfigError, VLLMEngineConfig
from asyncgrpo.base.engine_errors import EngineDied, EngineUnavailable, SyncTimeout
from asyncgrpo.inference.backend.base import SYNC_ATTEMPTS, NamedTensors, sync_until_landed
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.client.retry import RetryPolicy
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.inference.transport import make_transport
from asyncgrpo.inference.vllm.client import NO_RETRY, VLLMClient
from asyncgrpo.inference.vllm.generate_request import seeds_are_safe
from asyncgrpo.inference.vllm.launcher import VLLMServer, warn_if_exposed, weight_backend
from asyncgrpo.inference.vllm.lora import AdapterLoader, adapter_or_weights, adapter_root

logger = logging.getLogger(__name__)

DEATH_GRACE_S = 10.0  # a dropped connection during a sync has this long to show as a death
DEATH_POLL_S = 0.25


class VLLMBackend:
    """One vLLM server (launched, or attached to at `cfg.base_url`) and its weight sync."""

    sync_attempts = SYNC_ATTEMPTS  # a sync the engine's death interrupts is repeated

    def __init__(
        self,
        cfg: VLLMEngineConfig,
        log_path: Path | None = None,
        replica: int = 0,
        episodes: bool = False,
        server=None,
        nccl_address: str = "127.0.0.1",
    ):
        """`server`: what runs vLLM, if not a child process here (a vLLM server on a Ray
        node, `cluster.engines.ActorProcess`: it may come back at another address);
        `nccl_address`: where vLLM's workers reach this process for NCCL weight syncs."""
        if episodes and cfg.max_lora_rank is not None:
            raise ConfigError(
                "model.lora with engine.type vllm and agent episodes is not supported yet: "
                "the episode gateway generates on vLLM's base model and cannot ask for the "
                "run's adapter; use the embedded engine for LoRA agent runs"
            )
        self.cfg = cfg
        self.replica = replica
        self.log_path = Path(log_path) if log_path else None
        self.server = (
            None
            if cfg.base_url
            else server or VLLMServer(cfg, log_path=self.log_path, replica=replica)
        )
        self.nccl_address = nccl_address
        if cfg.base_url:
            warn_if_exposed("engine.base_url", cfg.base_url, urlparse(cfg.base_url).hostname or "")
        self.retry = RetryPolicy(deadline=cfg.startup_timeout_s, max_attempts=1000, max_backoff=2.0)
        url = cfg.base_url or self.server.base_url
        self.client = VLLMClient(url, retry=self.retry, weights_dir=cfg.weights_dir)
        self.transport = self._make_transport()
        self.adapters = AdapterLoader(self.client, cfg, adapter_root(cfg, self.log_path), replica)
        self.gateway = self._make_gateway() if episodes else None
        self.restarts = 0
        self.sync_timings: dict[str, float] = {}
        self._restart_lock = asyncio.Lock()

    def _make_transport(self):
        if self.cfg.weight_transport == "nccl":
            from asyncgrpo.inference.vllm.nccl import NCCLTransport

            return NCCLTransport(self.client, master_address=self.nccl_address)
        return make_transport(
            self.cfg.weight_transport, self.client, weights_dir=self.cfg.weights_dir
        )

    def _make_gateway(self) -> EngineProcess:
        """The episode gateway's process, and its client on `self.client.gateway`."""
        gateway_cfg = self.cfg.gateway_config(upstream_url=self.client.base_url)
        log = self.log_path.with_name(self.log_path.name + ".gateway") if self.log_path else None
        gateway = EngineProcess(gateway_cfg, log_path=log)
        # the port is known once started; `_start_gateway` points the client at it
        self.client.gateway = EngineClient(
            "http://127.0.0.1:0", admin_token=gateway.admin_token, retry=self.retry
        )
        return gateway

    @property
    def base_urls(self) -> list[str]:
        return [self.gateway.base_url if self.gateway else self.client.base_url]

    def launch(self) -> None:
        if self.server is not None:
            self.server.start()  # a no-op when already running

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        self.launch()
        if layout is not None:
            layout, adapter = adapter_or_weights(layout)
            if not adapter:  # lay the first sync's buffers out while vLLM loads
                await self.transport.prepare(list(layout))
        if self.server is not None:
            await asyncio.to_thread(self.server.wait_ready, self.cfg.startup_timeout_s)
            self.client.base_url = self.server.base_url
        else:
            await self.client.wait_until_healthy(self.cfg.startup_timeout_s)
        await self._check_server()
        await self._start_gateway()

    async def _check_server(self) -> None:
        """Refuse a server without the weight backend this run needs (an attached one may
        lack asyncgrpo's plugin); send seeds only to a server on an accelerator."""
        config = await self.client.vllm_config()
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != weight_backend(self.cfg):
            raise EngineDied(
                f"the vLLM server at {self.client.base_url} has weight-transfer backend "
                f"{backend!r}, not {weight_backend(self.cfg)!r}: start it with the arguments "
                "and environment `asyncgrpo.inference.vllm.launcher.VLLMServer` uses (docs/vllm.md)"
            )
        if self.cfg.max_lora_rank is not None and not config.get("lora_config"):
            raise EngineDied(
                f"the vLLM server at {self.client.base_url} does not serve LoRA adapters, "
                "which this run (engine.max_lora_rank) publishes: start it with --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        self.client.send_seed = seeds_are_safe((config.get("device_config") or {}).get("device"))

    async def _start_gateway(self) -> None:
        if self.gateway is None:
            return
        await asyncio.to_thread(self.gateway.start)
        self.client.gateway.base_url = self.gateway.base_url
        await asyncio.to_thread(self.gateway.wait_ready, self.cfg.startup_timeout_s)

    async def healthy(self) -> bool:
        """vLLM answers, and so does its episode gateway if it has one."""
        alive = self.server is None or self.server.alive()
        gateway = self.gateway is None or self.gateway.alive()
        return alive and gateway and await self.client.health()

    async def _dead(self) -> bool:
        if self.server is not None and not self.server.alive():
            return True
        return await self.client.engine_dead()

    async def revive(self) -> bool:
        async with self._restart_lock:
            if self.server is None:
                return False  # not ours to restart; the client's retries wait for it
            if not await self._dead():
                await self._revive_gateway()
                return False
            logger.warning(
                "vLLM engine %d died; restarting it (restart %d)", self.replica, self.restarts + 1
            )
            try:
                await self._restart()
            except Exception as exc:
                raise EngineDied(f"vLLM could not be restarted: {exc}") from exc
            return True

    async def _restart(self) -> None:
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
        await asyncio.to_thread(self.server.restart, self.cfg.startup_timeout_s)
        self.client.base_url = self.server.base_url
        self.restarts += 1
        self.client.forget_transfer_engine()
        self.adapters.forget()
        await self._check_server()
        await self._start_gateway()

    async def _revive_gateway(self) -> None:
        if self.gateway is not None and not self.gateway.alive():
            logger.warning(
                "the episode gateway of vLLM engine %d died; restarting it", self.replica
            )
            await asyncio.to_thread(self.gateway.stop)
            await self._start_gateway()

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        transport = self.transport
        weights, adapter = adapter_or_weights(weights)
        if adapter:
            self.adapters.check(weights)  # before pausing anything
            transport = self.adapters
        await sync_until_landed(
            self,
            transport,
            weights,
            version,
            mode,
            gone=lambda: self.server is not None and not self.server.alive(),
            on_stall=self._stalled,
            on_refused=self._refused,
            engine="vLLM",
            log=self.log_path,
        )

    async def _refused(self, exc: Exception, attempt: int) -> None:
        """A failed step: raise unless vLLM died under it (then the sync is repeated).

        A dropped connection gets `DEATH_GRACE_S` to show as a death: a killed engine
        actor reaches Ray, and its reaper kills the server, a moment after the request
        broke (a Ray test saw the sync raise in that moment)."""
        grace = DEATH_GRACE_S if isinstance(exc, EngineUnavailable) else 0.0
        if self.server is None or not await self._dies_within(grace):
            await self._resume_after_failure()
            raise exc
        logger.warning("vLLM died during weight sync: %s (attempt %d)", exc, attempt + 1)

    async def _dies_within(self, grace_s: float) -> bool:
        deadline = time.monotonic() + grace_s
        while not await self._dead():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DEATH_POLL_S)
        return True

    async def _stalled(self, exc: SyncTimeout) -> None:
        if self.server is None:
            raise EngineDied(
                f"{exc}: the vLLM server at {self.client.base_url} is stalled; it is not ours "
                "to restart"
            ) from exc
        logger.error("%s: killing vLLM to restart it", exc)
        await asyncio.to_thread(self.server.kill)

    async def _resume_after_failure(self) -> None:
        """A live server refused a step: do not leave it paused."""
        try:
            await self.client.request("POST", "/resume", retry=NO_RETRY)
        except Exception as exc:  # the original error is the one worth raising
            logger.warning("could not resume vLLM after a failed sync: %s", exc)

    async def close(self) -> None:
        try:
            await self.adapters.close()
            await asyncio.wait_for(self.transport.close(), 5)
            await asyncio.wait_for(self.client.aclose(), 5)
            if self.client.gateway is not None:
                await asyncio.wait_for(self.client.gateway.aclose(), 5)
        finally:
            if self.gateway is not None:
                await asyncio.to_thread(self.gateway.close)
            if self.server is not None:
                await asyncio.to_thread(self.server.close)

"""The `EngineBackend` protocol, and the weight-sync steps every backend shares.

Everything the trainer process does to an engine goes through this boundary, so
a vLLM server, several replicas or a Ray actor are new implementations, not
new branches in the training loop. Methods are coroutines on the rollout loop
(`loop_thread.py`), except `launch`, which only starts a process.

A weight sync has a deadline, `engine.sync_timeout_s` (peers that stall
without dying hang syncs forever in other frameworks: TRL #6796, NeMo-RL
#2694). While a sync is slow, `publish` says so every 10 s (4 times per
deadline when that is shorter), naming the step it waits in; at the deadline
it raises `SyncTimeout`, and the backend restarts the engine or gives up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from asyncgrpo.base.engine_errors import (
    EngineDied,
    EngineLostInSync,
    EngineRefused,
    EngineUnavailable,
    SyncTimeout,
)
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.transport import NamedTensors

logger = logging.getLogger(__name__)

SYNC_POLL_S = 0.5  # how often a sync in progress checks that its engine is still alive
SYNC_ATTEMPTS = 3  # a sync interrupted by a death or a stall this many times ends the run


class EngineBackend(Protocol):
    """The engine(s) that sample for this run, seen from the trainer."""

    client: EngineClient
    """Client for generation and control requests; its retries ride out a restart."""

    restarts: int
    """Times the engine was restarted after dying."""

    sync_timings: dict[str, float]
    """Seconds of the last weight sync's steps, as `publish` measures them (`pause_s`:
    the pause call, `paused_s`: from paused to resumed); empty before the first."""

    @property
    def base_urls(self) -> list[str]:
        """Where the engine(s) answer (agents' per-episode URLs are built on these)."""
        ...

    def launch(self) -> None:
        """Begin starting the engine without waiting, so it loads while the trainer loads."""
        ...

    async def wait_ready(self, layout: NamedTensors | None = None) -> None:
        """Wait until the engine answers health checks (`engine.startup_timeout_s`).

        `layout`, the weights the first sync will send, lets the transport prepare
        its buffers meanwhile.
        """
        ...

    async def healthy(self) -> bool:
        """True when the engine answers now."""
        ...

    async def revive(self) -> bool:
        """Restart the engine if it died; True when it did (it then holds its initial
        weights, so the caller syncs again). Raises `EngineDied` if it cannot."""
        ...

    async def sync_weights(self, weights: NamedTensors, version: int, mode: str) -> None:
        """Pause (`mode`: keep, abort or wait), transfer, resume: the engine samples with
        `weights`, stamping tokens with `version`. An engine that dies meanwhile is
        restarted and the sync repeated."""
        ...

    async def close(self) -> None:
        """Stop what this backend started and release the client and the transport."""
        ...


async def publish(
    client: EngineClient,
    transport,
    weights: NamedTensors,
    version: int,
    mode: str,
    *,
    timeout_s: float,
    gone: Callable[[], bool] = lambda: False,
    timings: dict[str, float] | None = None,
) -> None:
    """The sync on one engine (pause, send and finish with `version`, resume) within
    `timeout_s`: `SyncTimeout` after it, `EngineLostInSync` as soon as `gone()` is true.
    `timings`, if given, receives the seconds of each step (`pause_s`, `transfer_s`,
    `resume_s`) and the engine's paused time (`paused_s`, from pause to resumed)."""
    step = ["pausing the engine"]  # where the sync is, for the messages
    times = {} if timings is None else timings

    async def steps() -> None:
        t0 = time.monotonic()
        await client.pause(mode)
        t1 = time.monotonic()
        step[0] = "sending the weights"
        await transport.publish(weights, version)
        t2 = time.monotonic()
        step[0] = "resuming the engine"
        await client.resume()
        t3 = time.monotonic()
        times.update(pause_s=t1 - t0, transfer_s=t2 - t1, resume_s=t3 - t2, paused_s=t3 - t1)

    task = asyncio.ensure_future(steps())
    start = time.monotonic()
    log_every = min(10.0, timeout_s / 4)
    next_log = start + log_every
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=SYNC_POLL_S)
            now = time.monotonic()
            if task.done():
                break
            if gone():
                raise EngineLostInSync(f"the engine died during weight sync ({step[0]})")
            if now - start >= timeout_s:
                raise SyncTimeout(
                    f"weight sync of version {version} to the engine did not finish within "
                    f"{timeout_s:g} s (engine.sync_timeout_s); it was {step[0]}"
                )
            if now >= next_log:
                next_log += log_every
                logger.warning(
                    "weight sync to the engine has taken %.0f s (deadline %g s); %s",
                    now - start,
                    timeout_s,
                    step[0],
                )
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    task.result()  # raises what the sync raised


async def sync_until_landed(
    backend,
    transport,
    weights: NamedTensors,
    version: int,
    mode: str,
    *,
    gone: Callable[[], bool],
    on_stall: Callable[[SyncTimeout], Awaitable[None]],
    on_refused: Callable[[Exception, int], Awaitable[None]],
    engine: str,
    log: object,
) -> None:
    """`publish` to a backend's own engine until the sync lands.

    Before each attempt the backend revives a dead engine. A death during the sync
    (`EngineLostInSync`) repeats it; a stall (`SyncTimeout`) goes to `on_stall`, which kills
    the engine (the next attempt restarts it) or raises; an HTTP failure goes to
    `on_refused(exc, attempt)`, which raises, or returns to repeat the sync when the
    engine died under it. After `backend.sync_attempts` attempts, `EngineDied` names
    `engine` and its `log`.
    """
    timeout_s = backend.cfg.sync_timeout_s
    for attempt in range(backend.sync_attempts):
        await backend.revive()
        try:
            return await publish(
                backend.client,
                transport,
                weights,
                version,
                mode,
                timeout_s=timeout_s,
                gone=gone,
                timings=backend.sync_timings,
            )
        except EngineLostInSync as exc:
            logger.warning("%s (attempt %d)", exc, attempt + 1)
        except SyncTimeout as exc:
            await on_stall(exc)
        except (EngineUnavailable, EngineRefused) as exc:
            await on_refused(exc, attempt)
    raise EngineDied(
        f"weight sync failed {backend.sync_attempts} times: {engine} died or missed "
        f"engine.sync_timeout_s ({timeout_s:g} s) each time; see {log or 'its log'}"
    )

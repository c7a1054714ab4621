"""The trainer's side of the engine: start it, bring it back, send it the weights.

A weight sync publishes the trainer's weights, then tells the buffer the
engine's new version (its admission throttle counts from it). An engine that
restarted holds its initial weights, so `revive` sends the current ones again.
An engine that cannot start, or will not come back, aborts the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from asyncgrpo.backend import EngineBackend
from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.engine_errors import EngineDied, EngineStartError
from asyncgrpo.loop_thread import LoopThread
from asyncgrpo.session import RunAborted
from asyncgrpo.session.activity import Activity
from asyncgrpo.trainer.base import Trainer

logger = logging.getLogger(__name__)


class EngineLink:
    def __init__(
        self,
        engine: EngineBackend,
        loop: LoopThread,
        trainer: Trainer,
        buffer: RolloutBuffer,
        activity: Activity,
        weight_dtype: torch.dtype,
        sync_mode: str,
    ):
        """`loop`: the rollout loop, where the engine's coroutines run; `weight_dtype`: the
        engine's; `sync_mode`: what the engine does with requests in flight during a sync."""
        self.engine = engine
        self.loop = loop
        self.trainer = trainer
        self.buffer = buffer
        self.activity = activity
        self.weight_dtype = weight_dtype
        self.sync_mode = sync_mode
        self.weight_sync_s = 0.0  # the last sync's duration, as the trainer saw it
        self.restarts_before = 0  # engine restarts of the sessions this one resumes

    @property
    def restarts(self) -> int:
        """Engine restarts over the whole run."""
        return self.restarts_before + self.engine.restarts

    def start(self) -> None:
        """Wait for the engine; meanwhile the transport lays out the first sync."""
        layout = list(self.trainer.named_weights(self.weight_dtype))
        with self.activity.doing("waiting for the engine to start"):
            try:
                self.loop.run(self.engine.wait_ready(layout))
            except EngineStartError as exc:
                raise RunAborted(f"the engine did not start: {exc}") from None

    def sync_weights(self) -> None:
        """Publish the trainer's weights; the engine's version becomes the trainer's."""
        start = time.monotonic()
        version = self.trainer.version
        weights = list(self.trainer.named_weights(self.weight_dtype))
        with self.activity.doing(f"weight sync of version {version}", span="weight_sync"):
            try:
                self.loop.run(self.engine.sync_weights(weights, version, self.sync_mode))
            except EngineDied as exc:
                raise RunAborted(str(exc)) from exc
        self.buffer.set_engine_version(version)
        self.weight_sync_s = time.monotonic() - start

    def revive(self) -> None:
        """Restart a dead engine (the backend decides), then send it the current weights."""
        try:
            revived = self.loop.run(self.engine.revive())
        except EngineDied as exc:
            raise RunAborted(str(exc)) from exc
        if revived:
            version = self.trainer.version
            logger.warning("engine restarted; re-sending the weights of version %d", version)
            self.sync_weights()

    def pause_s(self) -> float | None:
        """How long the engine paused for its last sync, where the backend measures it."""
        return getattr(self.engine, "sync_timings", {}).get("pause_s")

    def close(self) -> None:
        try:
            self.loop.run(self.engine.close(), timeout=30)
        except Exception:
            logger.exception("closing the engine failed")


async def record_engine_busy(client: Any, tracker: Any, period: float = 0.5) -> None:
    """Turn the engine's cumulative busy seconds into timeline intervals. An engine that
    does not report them (vLLM) leaves `engine_busy_ratio` NaN rather than 0."""
    last_busy, last_t = None, tracker.elapsed()
    while True:
        await asyncio.sleep(period)
        try:
            stats = (await client.server_info()).get("stats", {})
        except Exception:
            continue
        if "busy_seconds" not in stats:
            tracker.timeline.engine_reports_busy = False
            return
        busy, now = float(stats["busy_seconds"]), tracker.elapsed()
        if last_busy is not None and busy > last_busy:
            # the busy part of the window, placed at its end
            tracker.timeline.record("engine", max(last_t, now - (busy - last_busy)), now)
        last_busy, last_t = busy, now

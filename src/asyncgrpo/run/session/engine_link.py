"""The trainer's side of the engine: start it, bring it back, send it the weights.

A weight sync publishes the trainer's weights, then tells the buffer the
engine's new version (its admission throttle counts from it). An engine that
restarted holds its initial weights, so `revive` sends the current ones again.
An engine that cannot start, or will not come back, aborts the run.

Where the weights live in host memory, the trainer only copies them into a
snapshot and goes on training while the sync lands in the background (the next
sync, `settle` or `landed` wait for it). On a 2-core Xeon a float32 sync of
SmolLM2-135M kept the trainer 0.37-0.44 s of each ~6 s step; the copy keeps it
0.07-0.10 s, and a copy that casts as it goes (no cast of its own first) 0.06-0.10 s.
Weights on a GPU are published in place, as before: a snapshot there would cost a
second copy of the model in device memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import torch

from asyncgrpo.base.engine_errors import EngineDied, EngineStartError
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.inference.backend import EngineBackend
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.trainer.base import Trainer
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.activity import Activity

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 30.0  # how long closing waits for a sync in flight


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
        self.snapshot = WeightSnapshot()
        self._pending: concurrent.futures.Future | None = None  # the sync in flight

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
        """Publish the trainer's weights; the engine's version becomes the trainer's once
        they land. Blocks until the last sync landed and this one's weights are copied."""
        self.settle()
        start = time.monotonic()
        version = self.trainer.version
        with self.activity.doing(f"weight sync of version {version}", span="weight_sync"):
            # cast on the way into the snapshot: one pass over the weights, where a cast
            # and then a copy made two (SmolLM2, one thread: 0.09 s against 0.17 s)
            gathered_as = self.weight_dtype if self.trainer.gathers_weights else None
            named = self.trainer.named_weights(gathered_as)
            weights = self.snapshot.take(named, self.weight_dtype)
            self._pending = self.loop.submit(self._publish(weights, version))
            if not self.snapshot.taken:  # the weights are the trainer's own: wait
                self.settle()
        self.weight_sync_s = time.monotonic() - start

    async def _publish(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.sync_weights(weights, version, self.sync_mode)
        self.buffer.set_engine_version(version)

    def settle(self) -> None:
        """Wait until the last sync landed; one that failed for good aborts the run."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.done():
            with self.activity.doing("waiting for the last weight sync to land"):
                concurrent.futures.wait([pending])
        try:
            pending.result()
        except EngineDied as exc:
            raise RunAborted(str(exc)) from exc

    async def landed(self) -> None:
        """On the rollout loop: wait until the last sync started has landed or failed (the
        trainer hears of a failure in `settle`)."""
        pending = self._pending
        if pending is not None:
            await asyncio.gather(asyncio.wrap_future(pending), return_exceptions=True)

    def revive(self) -> None:
        """Restart a dead engine (the backend decides), then send it the current weights.
        A sync in flight revives the engine itself, and repeats."""
        if self._pending is not None:
            if not self._pending.done():
                return
            self.settle()  # raises what it failed with
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
        """Close the engine, after a sync in flight (one that fails is not this one's to
        report: the run is over)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending], timeout=CLOSE_WAIT_S)
        try:
            self.loop.run(self.engine.close(), timeout=30)
        except Exception:
            logger.exception("closing the engine failed")


class WeightSnapshot:
    """Copies of the trainer's weights, in the engine's dtype, that a sync in flight reads
    while the trainer's own tensors change. The buffers are allocated once and reused, so
    only the first sync pays for their pages; tied tensors share one."""

    def __init__(self) -> None:
        self.taken = False  # whether the last `take` copied (not for weights on a GPU)
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, named: Any, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """`named`, (name, tensor) pairs, cast to `dtype` while copied into the snapshot
        when all are in host memory; otherwise the pairs cast (in place where they already
        have `dtype`)."""
        pairs = list(named)
        self.taken = all(t.device.type == "cpu" for _, t in pairs)
        if not self.taken:
            return [(name, tensor.to(dtype)) for name, tensor in pairs]
        copied: dict[tuple, torch.Tensor] = {}  # by `_identity`: tied tensors copy once
        out = []
        with torch.no_grad():
            for name, tensor in pairs:
                key = _identity(tensor)
                if key not in copied:
                    copied[key] = self._buffer(name, tensor.shape, dtype).copy_(tensor)
                out.append((name, copied[key]))
        return out

    def _buffer(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = self._buffers[name] = torch.empty(shape, dtype=dtype)
        return buffer


def _identity(tensor: torch.Tensor) -> tuple:
    """Equal for two views of the same elements (a tied embedding and head)."""
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


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

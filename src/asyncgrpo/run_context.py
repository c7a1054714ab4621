"""The wired roles of one run, and the chores between optimizer steps.

`wiring.build_run` creates a `RunContext`; the two halves of the algorithm in
`run.py` use it. Each role sits behind its own interface (`EngineBackend`,
`GroupBuilder`, `Trainer`, the buffer); this class only holds them together
and does what touches several at once: a weight sync (trainer -> engine ->
buffer's engine version), waiting for a batch while watching the engine and
the producer, a metric row, a checkpoint with the data position, and an
orderly shutdown that writes the accounting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.backend import EngineBackend, EngineDied
from asyncgrpo.config import RunConfig
from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.evaluation import Evaluator
from asyncgrpo.loop_thread import LoopThread
from asyncgrpo.metrics.rows import StepRows
from asyncgrpo.rollout.builder import GroupBuilder
from asyncgrpo.rollout.orchestrator import Orchestrator
from asyncgrpo.rollout.prompts import PromptStream
from asyncgrpo.rollout.types import Group
from asyncgrpo.trainer.base import Trainer
from asyncgrpo.trainer.checkpoint import Checkpointer

logger = logging.getLogger(__name__)


class RunAborted(RuntimeError):
    """The run cannot continue (a fatal reward error, an engine that will not come back)."""


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    loop: LoopThread
    engine: EngineBackend
    builder: GroupBuilder
    buffer: RolloutBuffer
    prompts: PromptStream
    orchestrator: Orchestrator
    trainer: Trainer
    evaluator: Evaluator
    checkpoints: Checkpointer
    rows: StepRows
    tracker: Any
    weight_dtype: torch.dtype
    closers: list = field(default_factory=list)  # more to close at the end (reward pools)
    start_time: float = field(default_factory=time.monotonic)
    weight_sync_s: float = 0.0
    producer: concurrent.futures.Future | None = None

    @property
    def step(self) -> int:
        return self.trainer.version

    def start_engine(self) -> None:
        """Wait for the engine; meanwhile the transport lays out the first sync."""
        layout = list(self.trainer.named_weights(self.weight_dtype))
        self.loop.run(self.engine.wait_ready(layout))

    def sync_weights(self) -> None:
        """Publish the trainer's weights; the engine's version becomes the trainer's."""
        start = time.monotonic()
        version = self.trainer.version
        weights = list(self.trainer.named_weights(self.weight_dtype))
        with self.tracker.span("weight_sync"):
            try:
                self.loop.run(
                    self.engine.sync_weights(weights, version, self.cfg.coordinator.sync_mode)
                )
            except EngineDied as exc:
                raise RunAborted(str(exc)) from exc
        self.buffer.set_engine_version(version)
        self.weight_sync_s = time.monotonic() - start

    def out_of_time(self) -> bool:
        budget = self.cfg.max_time_s
        return budget is not None and time.monotonic() - self.start_time >= budget

    def next_batch(self, stop: threading.Event) -> list[Group] | None:
        """Wait for a full batch of fresh groups, watching the engine and the producer.

        Returns None when `stop` is set while waiting.
        """
        waited = 0.0
        while not stop.is_set():
            self._check_producer()
            self._revive_engine()
            try:
                return self.buffer.get_batch(self.trainer.version, timeout=1.0)
            except TimeoutError:
                waited += 1.0
                if waited > self.cfg.rollout.request_timeout_s:
                    raise RunAborted(
                        f"no batch for {waited:.0f}s: {self.buffer.snapshot()}"
                    ) from None
        return None

    def _check_producer(self) -> None:
        if self.orchestrator.fatal is not None:
            raise RunAborted(f"reward function failed: {self.orchestrator.fatal}")
        if self.producer is not None and self.producer.done() and self.producer.exception():
            raise RunAborted(f"rollouts stopped: {self.producer.exception()!r}")

    def _revive_engine(self) -> None:
        """A restarted engine holds its initial weights: send the current ones."""
        try:
            revived = self.loop.run(self.engine.revive())
        except EngineDied as exc:
            raise RunAborted(str(exc)) from exc
        if revived:
            logger.warning("engine restarted; re-sending the weights of version %d", self.step)
            self.sync_weights()

    def consumed(self, groups: list[Group]) -> None:
        for g in groups:
            self.prompts.done(g.data_index)

    def checkpoint(self, force: bool = False) -> None:
        elapsed = time.monotonic() - self.start_time
        self.checkpoints.maybe_save(self.step, self.prompts.state(), elapsed, force=force)

    def resume(self) -> None:
        try:
            state = self.checkpoints.resume()
        except FileNotFoundError as exc:
            raise RunAborted(str(exc)) from None
        self.prompts.load_state(state.data_position)
        self.start_time -= float(state.extra.get("time_s", 0.0))
        self.tracker.truncate_after(state.step)
        logger.info("resumed at step %d", state.step)

    def log(self, metrics: dict[str, Any], groups: list[Group]) -> dict[str, Any]:
        return self.rows.log(
            self.step,
            metrics,
            groups,
            time_s=time.monotonic() - self.start_time,
            version=self.trainer.version,
            weight_sync_s=self.weight_sync_s,
        )

    def accounting(self) -> dict[str, Any]:
        """Where every admitted group went; `admitted` equals the sum of the rest."""
        return {
            **self.buffer.snapshot(),
            "failures": dict(self.orchestrator.failures),
            "engine_restarts": self.engine.restarts,
        }

    def close(self) -> None:
        """Stop rollouts, the loop thread and the engine; safe to call twice."""
        self.orchestrator.stop()
        self.buffer.close()
        if self.producer is not None:
            try:  # let the producer cancel its group tasks before counting
                self.producer.result(timeout=10)
            except Exception:
                pass
        (self.run_dir / "accounting.json").write_text(json.dumps(self.accounting(), indent=1))
        try:
            self.loop.run(self.engine.close(), timeout=30)
        except Exception:
            logger.exception("closing the engine failed")
        self.loop.stop()
        for close in self.closers:
            close()
        self.checkpoints.close()
        self.tracker.close()


async def record_engine_busy(client: Any, tracker: Any, period: float = 0.5) -> None:
    """Turn the engine's cumulative busy seconds into timeline intervals."""
    last_busy, last_t = None, tracker.elapsed()
    while True:
        await asyncio.sleep(period)
        try:
            stats = (await client.server_info()).get("stats", {})
        except Exception:
            continue
        busy, now = float(stats.get("busy_seconds", 0.0)), tracker.elapsed()
        if last_busy is not None and busy > last_busy:
            # the busy part of the window, placed at its end
            tracker.timeline.record("engine", max(last_t, now - (busy - last_busy)), now)
        last_busy, last_t = busy, now

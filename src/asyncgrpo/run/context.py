"""The wired parts of one run, held together for the loop in `loop.py`.

`build.py` assembles them (the only place that does); this is what it returns. Each
role sits behind its own
interface (`EngineBackend`, `GroupBuilder`, `Trainer`, the buffer and its
ledger), and each concern between them has one owner in `session/`: the engine
link (start, revive, weight syncs), the clock, the wait for a batch, what the
trainer's thread is doing, and the pipeline's status for the watchdog. What is
left here touches several at once: resume, checkpoint, a metric row, shutdown.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.base.config import RunConfig
from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.metrics.rows import StepRows
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.rollout.prompts import PromptStream
from asyncgrpo.learning.rollout.rewards import TrainerState
from asyncgrpo.learning.rollout.types import Group
from asyncgrpo.learning.trainer.base import Trainer
from asyncgrpo.learning.trainer.checkpoint import Checkpointer, CheckpointNotWritten
from asyncgrpo.run.evaluation import Evaluator
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.activity import Activity
from asyncgrpo.run.session.batches import BatchWaiter
from asyncgrpo.run.session.clock import RunClock
from asyncgrpo.run.session.engine_link import EngineLink
from asyncgrpo.run.session.status import PipelineStatus
from asyncgrpo.run.watchdog import Watchdog

logger = logging.getLogger(__name__)

__all__ = ["RunContext"]


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    loop: LoopThread
    link: EngineLink
    buffer: RolloutBuffer
    prompts: PromptStream
    orchestrator: Orchestrator
    trainer: Trainer
    evaluator: Evaluator
    checkpoints: Checkpointer
    rows: StepRows
    tracker: Any
    activity: Activity
    clock: RunClock
    batches: BatchWaiter
    status: PipelineStatus
    closers: list = field(default_factory=list)  # more to close at the end (rewards, Ray)
    rewards: Any = None  # the RewardRunner: reward functions see the trainer's state
    producer: concurrent.futures.Future | None = None  # the rollouts, on the loop thread
    watchdog: Watchdog | None = None

    @property
    def step(self) -> int:
        return self.trainer.version

    @property
    def engine(self) -> Any:
        return self.link.engine

    def start_watchdog(self) -> None:
        """Log what the run waits for whenever nothing moves (`watchdog.py`)."""
        self.watchdog = Watchdog.over(self.cfg.coordinator.watchdog_s, self.status)
        self.watchdog.start()

    def publish_trainer_state(self) -> None:
        """Tell reward functions (`trainer_state=`) where training is."""
        if self.rewards is None:
            return
        epoch = self.prompts.cursor / len(self.prompts.rows)
        self.rewards.trainer_state = TrainerState(self.step, self.cfg.max_steps, epoch)

    def checkpoint(self, force: bool = False) -> None:
        with self.activity.doing("checkpoint"):
            try:
                self.checkpoints.maybe_save(
                    self.step, self._progress, self.clock.elapsed(), force=force
                )
            except CheckpointNotWritten as exc:
                raise RunAborted(str(exc)) from None

    def _progress(self) -> tuple[dict, dict]:
        """The data position and the accounting, taken together (`RolloutBuffer.record`)."""
        position, record = self.buffer.record(self.prompts.state)
        return position, self._accounting(record)

    def _accounting(self, record: dict) -> dict[str, Any]:
        return {**record, "engine_restarts": self.link.restarts}

    def resume(self) -> None:
        try:
            state = self.checkpoints.resume()
        except FileNotFoundError as exc:
            raise RunAborted(str(exc)) from None
        self.prompts.load_state(state.data_position)
        record = state.extra.get("accounting")
        if record:  # the totals go on from the checkpoint's
            self.buffer.carry_over(record)
            self.link.restarts_before = int(record.get("engine_restarts", 0))
        self.clock.resumed(self.step, float(state.extra.get("time_s", 0.0)))
        self.tracker.truncate_after(state.step)
        logger.info("resumed at step %d", state.step)

    def log(self, metrics: dict[str, Any], groups: list[Group]) -> dict[str, Any]:
        return self.rows.log(
            self.step,
            metrics,
            groups,
            time_s=self.clock.elapsed(),
            version=self.trainer.version,
            weight_sync_s=self.link.weight_sync_s,
            engine_pause_s=self.link.pause_s(),
        )

    def accounting(self) -> dict[str, Any]:
        """Where every admitted group went, over the whole run (resumed sessions included):
        the buffer's ledger, what is queued and in flight, and the engine's restarts;
        `admitted` equals the sum of the rest."""
        return self._accounting(self.buffer.snapshot())

    def close(self) -> None:
        """Stop rollouts, the loop thread and the engine; safe to call twice."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.orchestrator.stop()
        self.buffer.close()
        if self.producer is not None:
            try:  # let the producer cancel its group tasks before counting
                self.producer.result(timeout=10)
            except Exception:
                pass
        self.checkpoints.write_accounting(self.accounting())
        self.link.close()
        self.loop.stop()
        self.checkpoints.close()
        self.trainer.close()  # a data-parallel trainer stops its other ranks
        for close in self.closers:  # reward pools, then the Ray cluster's actors
            close()
        self.tracker.close()

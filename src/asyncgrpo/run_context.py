"""The wired roles of one run, and the chores between optimizer steps.

`wiring.build_run` creates a `RunContext`; the two halves of the algorithm in
`run.py` use it. Each role sits behind its own interface (`EngineBackend`,
`GroupBuilder`, `Trainer`, the buffer); this class only holds them together
and does what touches several at once: a weight sync (trainer -> engine ->
buffer's engine version), waiting for a batch while watching the engine and
the producer, a metric row, a checkpoint with the data position and the
accounting, and an orderly shutdown. It also says what the trainer's thread is
doing (`activity`), which the watchdog (`watchdog.py`) reports when nothing
moves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from asyncgrpo.rollout.rewards import TrainerState
from asyncgrpo.rollout.types import Group
from asyncgrpo.trainer.base import Trainer
from asyncgrpo.trainer.checkpoint import Checkpointer
from asyncgrpo.watchdog import Watchdog, pipeline_report, progress_mark

logger = logging.getLogger(__name__)

LOOP_ANSWER_S = 60.0  # the rollout loop answers a bookkeeping call within this, or is stuck


class RunAborted(RuntimeError):
    """The run cannot continue (a fatal reward error, an engine that will not come back,
    every group dropped)."""


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
    closers: list = field(default_factory=list)  # more to close at the end (rewards, Ray)
    rewards: Any = None  # the RewardRunner, whose running calls the watchdog reports
    start_time: float = field(default_factory=time.monotonic)
    weight_sync_s: float = 0.0
    producer: concurrent.futures.Future | None = None
    activity: tuple[str, float] = field(default_factory=lambda: ("starting", time.monotonic()))
    _doing_depth: int = 0
    restarts_before: int = 0  # engine restarts of the sessions this one resumes
    first_step: int = 0  # the step this session began at (a resumed run's checkpoint)
    watchdog: Watchdog | None = None

    @property
    def step(self) -> int:
        return self.trainer.version

    @contextmanager
    def doing(self, what: str, span: str | None = None) -> Iterator[None]:
        """Mark what the trainer's thread does (for the watchdog), and its timeline span.
        Nested (a sync while waiting for a batch), the outer activity comes back after."""
        outer = self.activity if self._doing_depth else None
        self.activity, self._doing_depth = (what, time.monotonic()), self._doing_depth + 1
        try:
            if span is None:
                yield
            else:
                with self.tracker.span(span):
                    yield
        finally:
            self._doing_depth -= 1
            self.activity = outer or (f"done with {what}", time.monotonic())

    def start_engine(self) -> None:
        """Wait for the engine; meanwhile the transport lays out the first sync."""
        from asyncgrpo.engine.process import EngineProcessError

        layout = list(self.trainer.named_weights(self.weight_dtype))
        with self.doing("waiting for the engine to start"):
            try:
                self.loop.run(self.engine.wait_ready(layout))
            except EngineProcessError as exc:
                raise RunAborted(f"the engine did not start: {exc}") from None

    def start_watchdog(self) -> None:
        period = self.cfg.coordinator.watchdog_s
        self.watchdog = Watchdog(period, lambda: progress_mark(self), self.report)
        self.watchdog.start()

    def report(self) -> str:
        """What every stage is doing now (the watchdog's line)."""
        return pipeline_report(self)

    def sync_weights(self) -> None:
        """Publish the trainer's weights; the engine's version becomes the trainer's."""
        start = time.monotonic()
        version = self.trainer.version
        weights = list(self.trainer.named_weights(self.weight_dtype))
        with self.doing(f"weight sync of version {version}", span="weight_sync"):
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

    def time_up(self) -> bool:
        """`max_time_s` is spent after this session's first step: a normal end."""
        return self.out_of_time() and self.step > self.first_step

    def next_batch(self, stop: threading.Event) -> list[Group] | None:
        """Wait for a full batch of fresh groups, watching the engine and the producer.

        Returns None when `stop` is set or `max_time_s` is spent while waiting; aborts
        after `request_timeout_s`, when the orchestrator finds that no group can succeed, or
        when `max_time_s` is spent before this session's first batch.
        """
        timeout = self.cfg.rollout.request_timeout_s
        deadline = time.monotonic() + timeout
        with self.doing("waiting for a batch"):
            while not stop.is_set():
                self._check_producer()
                self._revive_engine()
                if self.out_of_time():
                    if self.step == self.first_step:  # nothing trained: a failure, not an end
                        raise RunAborted(self._no_batch_in_time())
                    logger.warning(
                        "max_time_s (%g s) is spent while waiting for a batch: stopping | %s",
                        self.cfg.max_time_s,
                        self.report(),
                    )
                    return None
                try:
                    return self.buffer.get_batch(self.trainer.version, timeout=1.0)
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise RunAborted(
                            f"no batch within {timeout:g} s (rollout.request_timeout_s) | "
                            f"{self.report()}"
                        ) from None
        return None

    def _no_batch_in_time(self) -> str:
        return (
            f"no batch came within max_time_s ({self.cfg.max_time_s:g} s), so no optimizer "
            "step was taken. Likely causes: every group is dropped ('dropped' below, the first "
            "error above), a reward function or the engine slower than the budget, or a batch "
            "too big for it (raise max_time_s, or lower coordinator.batch_groups, "
            f"rollout.num_generations or rollout.max_tokens) | {self.report()}"
        )

    def _check_producer(self) -> None:
        if self.orchestrator.fatal is not None:
            raise RunAborted(str(self.orchestrator.fatal))
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
        """The groups were trained on: their prompts are done, reward functions see the step."""
        for g in groups:
            self.prompts.done(g.data_index)
        self.publish_trainer_state()

    def publish_trainer_state(self) -> None:
        """Tell reward functions (`trainer_state=`) where training is."""
        if self.rewards is None:
            return
        epoch = self.prompts.cursor / len(self.prompts.rows)
        self.rewards.trainer_state = TrainerState(self.step, self.cfg.max_steps, epoch)

    def checkpoint(self, force: bool = False) -> None:
        elapsed = time.monotonic() - self.start_time
        with self.doing("checkpoint"):
            self.checkpoints.maybe_save(self.step, self._progress, elapsed, force=force)

    def _progress(self) -> tuple[dict, dict]:
        """The data position and the accounting, taken together on the rollout loop, where
        groups finish: a group is then either counted and done, or neither."""

        async def both() -> tuple[dict, dict]:
            return self.prompts.state(), self.accounting()

        try:
            return self.loop.run(both(), timeout=LOOP_ANSWER_S)
        except concurrent.futures.TimeoutError:
            raise RunAborted(
                f"the rollout loop did not answer within {LOOP_ANSWER_S:.0f} s: something "
                f"running on it blocks (an async reward or rollout function?) | {self.report()}"
            ) from None

    def resume(self) -> None:
        try:
            state = self.checkpoints.resume()
        except FileNotFoundError as exc:
            raise RunAborted(str(exc)) from None
        self.prompts.load_state(state.data_position)
        counts = state.extra.get("accounting")
        if counts:  # the totals go on from the checkpoint's
            self.buffer.carry_over(counts)
            self.orchestrator.failures.update(counts.get("failures", {}))
            self.restarts_before = int(counts.get("engine_restarts", 0))
        self.start_time -= float(state.extra.get("time_s", 0.0))
        self.first_step = self.step
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
            engine_pause_s=getattr(self.engine, "sync_timings", {}).get("pause_s"),
        )

    def accounting(self) -> dict[str, Any]:
        """Where every admitted group went, over the whole run (resumed sessions included);
        `admitted` equals the sum of the rest."""
        return {
            **self.buffer.snapshot(),
            "failures": dict(self.orchestrator.failures),
            "engine_restarts": self.restarts_before + self.engine.restarts,
        }

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
        try:
            self.loop.run(self.engine.close(), timeout=30)
        except Exception:
            logger.exception("closing the engine failed")
        self.loop.stop()
        self.checkpoints.close()
        self.trainer.close()  # a data-parallel trainer stops its other ranks
        for close in self.closers:  # reward pools, then the Ray cluster's actors
            close()
        self.tracker.close()


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

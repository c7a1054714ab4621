"""What every stage of the run is doing now, on one line: the watchdog's report.

It only observes (the buffer's counts, the groups being built, the trainer's
activity, the engine's health, the reward calls running), from whichever thread
asks, so it answers even when the trainer's thread or the rollout loop is the
stuck part:

    trainer: waiting for a batch for 61 s (step 3) | buffer: 1 of 2 groups queued, 3 in
    flight, ... | building 3 groups, the oldest for 61 s (group 17) | engine: healthy,
    0 restarts | reward calls: 'judge' 58 s
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Hashable
from typing import Any

from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.trainer.base import Trainer
from asyncgrpo.run.session.activity import Activity
from asyncgrpo.run.session.engine_link import EngineLink

HEALTH_TIMEOUT_S = 10.0  # the engine client's own health check gives up after 5 s


class PipelineStatus:
    """The run's `watchdog.RunStatus`."""

    def __init__(
        self,
        activity: Activity,
        buffer: RolloutBuffer,
        orchestrator: Orchestrator,
        link: EngineLink,
        trainer: Trainer,
        rewards: Any = None,
    ):
        """`rewards`: the `RewardRunner` whose running calls are reported, if any."""
        self.activity = activity
        self.buffer = buffer
        self.orchestrator = orchestrator
        self.link = link
        self.trainer = trainer
        self.rewards = rewards

    def progress_mark(self) -> Hashable:
        """What changes whenever the run moves."""
        s = self.buffer.snapshot()
        finished = sum(s["dropped"].values())
        return (s["admitted"], s["consumed"], s["queued"], finished, self.activity.current)

    def report(self) -> str:
        doing, since = self.activity.current
        s = self.buffer.snapshot()
        parts = [
            f"trainer: {doing} for {time.monotonic() - since:.0f} s (step {self.trainer.version})",
            f"buffer: {s['queued']} of {self.buffer.batch_groups} groups queued, "
            f"{s['in_flight']} in flight, {s['admitted']} admitted, {s['consumed']} consumed, "
            f"dropped {s['dropped']}, engine version {s['engine_version']}",
            _building(self.orchestrator.building()),
            f"engine: {self._engine_health()}, {self.link.engine.restarts} restarts",
        ]
        if self.rewards is not None:
            parts.append(f"reward calls: {self.rewards.running.describe()}")
        return " | ".join(parts)

    def _engine_health(self) -> str:
        try:
            future = self.link.loop.submit(self.link.engine.healthy())
        except RuntimeError:
            return "unknown (the rollout loop is closed)"
        try:
            healthy = future.result(timeout=HEALTH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return f"unknown (the rollout loop did not answer within {HEALTH_TIMEOUT_S:.0f} s)"
        except Exception as exc:
            return f"health check failed ({type(exc).__name__}: {exc})"
        return "healthy" if healthy else "not answering its health check"


def _building(groups: list[tuple[int, float]]) -> str:
    if not groups:
        return "no group being built"
    group_id, age = groups[0]
    return f"building {len(groups)} groups, the oldest for {age:.0f} s (group {group_id})"

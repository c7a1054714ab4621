"""The wait for the next batch, under its deadlines.

The trainer's thread waits on the buffer in one-second slices, and between
them looks at what could mean no batch will ever come: the rollouts stopped
(a fatal reward error, every group dropped, a bug in the producer), the engine
died (it is revived and sent the weights again), or a deadline passed:

- `rollout.request_timeout_s` without a batch aborts the run;
- `max_time_s` spent while waiting ends the run normally, unless this session
  has not trained yet: then nothing was learned, and the run aborts saying why
  (the sessions it resumes had spent the budget, or no batch came within it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.rollout.orchestrator import Orchestrator
from asyncgrpo.learning.rollout.types import Group
from asyncgrpo.run.session import RunAborted
from asyncgrpo.run.session.activity import Activity
from asyncgrpo.run.session.clock import RunClock
from asyncgrpo.run.session.engine_link import EngineLink

logger = logging.getLogger(__name__)


class BatchWaiter:
    def __init__(
        self,
        buffer: RolloutBuffer,
        orchestrator: Orchestrator,
        link: EngineLink,
        clock: RunClock,
        activity: Activity,
        request_timeout_s: float,
        report: Callable[[], str],
    ):
        """`report()`: what every stage is doing, for the messages of an abort."""
        self.buffer = buffer
        self.orchestrator = orchestrator
        self.link = link
        self.clock = clock
        self.activity = activity
        self.request_timeout_s = request_timeout_s
        self.report = report

    def next(self, stop: threading.Event, step: int) -> list[Group] | None:
        """A full batch of fresh groups for the trainer at `step`; None when `stop` is set or
        `max_time_s` is spent while waiting."""
        deadline = time.monotonic() + self.request_timeout_s
        with self.activity.doing("waiting for a batch"):
            while not stop.is_set():
                if self.orchestrator.fatal is not None:
                    raise RunAborted(str(self.orchestrator.fatal))
                self.link.revive()
                if self.clock.out_of_time():
                    return self._out_of_time(step)
                try:
                    return self.buffer.get_batch(step, timeout=1.0)
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise RunAborted(
                            f"no batch within {self.request_timeout_s:g} s "
                            f"(rollout.request_timeout_s) | {self.report()}"
                        ) from None
        return None

    def _out_of_time(self, step: int) -> None:
        budget = self.clock.max_time_s
        if step == self.clock.first_step and self.clock.spent_before():
            raise RunAborted(
                f"max_time_s ({budget:g} s) was spent before this session began: the run it "
                f"resumes had trained for {self.clock.before_s:.0f} s up to step {step} (the "
                "budget counts every session's time). To train on, resume with a larger "
                "budget, e.g. --set max_time_s=..."
            )
        if step == self.clock.first_step:  # nothing trained: a failure, not an end
            before = self.clock.before_s
            left = f" (the {budget - before:.0f} s that earlier sessions left)" if before else ""
            raise RunAborted(
                f"no batch came within max_time_s ({budget:g} s){left}, so no optimizer step was "
                "taken. Likely causes: every group is dropped ('dropped' below, the first "
                "error above), a reward function or the engine slower than the budget, or a "
                "batch too big for it (raise max_time_s, or lower coordinator.batch_groups, "
                f"rollout.num_generations or rollout.max_tokens) | {self.report()}"
            )
        logger.warning(
            "max_time_s (%g s) is spent while waiting for a batch: stopping | %s",
            budget,
            self.report(),
        )
        return None

"""The watchdog: when nothing moves, say what the run is waiting for.

Hangs that are not crashes look alike from outside: silence (a stuck reward
function, verl #6673; a buffer waiting for a lost rollout, verl #7155). A
daemon thread looks once a second; when nothing has progressed for
`coordinator.watchdog_s` seconds (no group admitted, finished or dropped, no
change in what the trainer's thread does: step, sync, checkpoint, wait) it logs
one line with the state of every stage, and repeats it every `watchdog_s`
while the stall lasts:

    nothing has progressed for 60 s | trainer: waiting for a batch for 61 s |
    buffer: 1 of 2 groups queued, 3 in flight, ... | building 3 groups, the oldest
    for 61 s (group 17) | engine: healthy, 0 restarts | reward calls: 'judge' 58 s

It only observes, from its own thread, so it reports even when the trainer's
thread or the rollout loop is the stuck part. What it observes is a `RunStatus`
(the run's is `session/status.py`). What ends a stall is a deadline:
`rollout.reward_timeout_s`, `engine.sync_timeout_s`, `rollout.request_timeout_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Protocol

logger = logging.getLogger(__name__)

STOP_WAIT_S = 11.0  # a report may wait this long for the engine's health check


class RunStatus(Protocol):
    """What the watchdog watches."""

    def progress_mark(self) -> Hashable:
        """A value that changes whenever the run moves."""
        ...

    def report(self) -> str:
        """What every stage is doing now, on one line."""
        ...


class Watchdog:
    """Logs `report()` when `progress()` has not changed for `period_s` seconds."""

    def __init__(
        self,
        period_s: float,
        progress: Callable[[], Hashable],
        report: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.period_s = period_s
        self.progress = progress
        self.report = report
        self.clock = clock
        self._mark: Hashable = object()  # differs from any first observation
        self._since = self._next = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def over(cls, period_s: float, status: RunStatus) -> Watchdog:
        return cls(period_s, status.progress_mark, status.report)

    def check(self) -> str | None:
        """One look: the line it logged, if the run has been still for a period (or another)."""
        now, mark = self.clock(), self.progress()
        if mark != self._mark:
            self._mark, self._since, self._next = mark, now, now + self.period_s
            return None
        if now < self._next:
            return None
        self._next = now + self.period_s
        line = f"nothing has progressed for {now - self._since:.0f} s | {self.report()}"
        logger.warning(line)
        return line

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.period_s / 4)):
            try:
                self.check()
            except Exception:  # a report that fails must not end the watching
                logger.exception("the watchdog's report failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)

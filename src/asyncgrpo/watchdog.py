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
thread or the rollout loop is the stuck part. What ends a stall is a deadline:
`rollout.reward_timeout_s`, `engine.sync_timeout_s`, `rollout.request_timeout_s`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0  # the engine client's own health check gives up after 5 s


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
            self._thread.join(HEALTH_TIMEOUT_S + 1)


def progress_mark(r: Any) -> Hashable:
    """What changes whenever the run moves (`r` is a `RunContext`)."""
    s = r.buffer.snapshot()
    finished = sum(s["dropped"].values())
    return (s["admitted"], s["consumed"], s["queued"], finished, r.activity)


def pipeline_report(r: Any) -> str:
    """What every stage of the run `r` (a `RunContext`) is doing, on one line."""
    doing, since = r.activity
    s = r.buffer.snapshot()
    parts = [
        f"trainer: {doing} for {time.monotonic() - since:.0f} s (step {r.step})",
        f"buffer: {s['queued']} of {r.buffer.batch_groups} groups queued, {s['in_flight']} in "
        f"flight, {s['admitted']} admitted, {s['consumed']} consumed, dropped {s['dropped']}, "
        f"engine version {s['engine_version']}",
        _building(r.orchestrator.building()),
        f"engine: {_engine_health(r)}, {r.engine.restarts} restarts",
    ]
    if r.rewards is not None:
        parts.append(f"reward calls: {r.rewards.running.describe()}")
    return " | ".join(parts)


def _building(groups: list[tuple[int, float]]) -> str:
    if not groups:
        return "no group being built"
    group_id, age = groups[0]
    return f"building {len(groups)} groups, the oldest for {age:.0f} s (group {group_id})"


def _engine_health(r: Any) -> str:
    try:
        future = r.loop.submit(r.engine.healthy())
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

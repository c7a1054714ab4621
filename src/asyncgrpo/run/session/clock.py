"""The session's clock: when it started, the `max_time_s` budget, the step it began at.

A resumed run's budget counts the time of the sessions before it (`resumed`).
Running out of time after this session's first step is a normal end
(`time_up`); before it, nothing was trained, which `BatchWaiter` reports as a
failure: as a budget the earlier sessions had already spent (`spent_before`)
when they had, else as batches that did not come in time.
"""

from __future__ import annotations

import time


class RunClock:
    def __init__(self, max_time_s: float | None):
        self.max_time_s = max_time_s
        self.start = time.monotonic()
        self.first_step = 0  # the step this session began at (a resumed run's checkpoint)
        self.before_s = 0.0  # seconds the sessions this one resumes had run

    def elapsed(self) -> float:
        """Seconds of the whole run, earlier sessions included."""
        return time.monotonic() - self.start

    def out_of_time(self) -> bool:
        return self.max_time_s is not None and self.elapsed() >= self.max_time_s

    def time_up(self, step: int) -> bool:
        """`max_time_s` is spent after this session's first step: a normal end."""
        return self.out_of_time() and step > self.first_step

    def resumed(self, step: int, elapsed_s: float) -> None:
        """This session continues a run that had run `elapsed_s` seconds up to `step`."""
        self.start -= elapsed_s
        self.first_step = step
        self.before_s = elapsed_s

    def spent_before(self) -> bool:
        """The earlier sessions had spent the whole budget: this one had none to train in."""
        return self.max_time_s is not None and self.before_s >= self.max_time_s

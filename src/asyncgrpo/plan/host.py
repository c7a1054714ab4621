"""Roles that share one host's cores: processor sharing, as one work clock.

On a laptop or a CPU node the engines and the trainer are threads on the same cores.
While more threads are busy than there are cores, each busy thread runs at
`cores / busy threads` of its own speed (the OS shares the cores evenly; a role's
costs are those it shows running alone). Since every busy role then advances at the
same rate, one clock measures all their progress: `work(t)` is the work a busy role
has done by wall time `t`, in seconds of running alone. The simulator schedules a
role's computation in work seconds and converts its end to wall time with the rate of
the moment, again whenever the number of busy threads changes the rate.

Waiting (the weight transfer, the engine's pause, the trainer's bookkeeping) takes wall
time and no core. Memory bandwidth and caches are not shared in this model, only cores.
"""

from __future__ import annotations


class WorkClock:
    """Work seconds of a busy role, against wall seconds, under processor sharing."""

    def __init__(self, cores: float):
        if cores <= 0:
            raise ValueError("shared cores must be positive")
        self.cores = cores
        self.rate = 1.0  # work seconds per wall second for each busy role
        self._work = 0.0  # work done by `_at`
        self._at = 0.0

    def work(self, wall: float) -> float:
        return self._work + (wall - self._at) * self.rate

    def wall(self, now: float, work_end: float) -> float:
        """When a busy role reaches `work_end`, at the rate of `now`."""
        return now + (work_end - self.work(now)) / self.rate

    def share(self, now: float, busy_threads: int) -> bool:
        """The busy threads from `now` on; True when that changes the rate."""
        rate = 1.0 if busy_threads <= self.cores else self.cores / busy_threads
        if rate == self.rate:
            return False
        self._work, self._at, self.rate = self.work(now), now, rate
        return True

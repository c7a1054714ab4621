"""What the trainer's thread is doing now, and since when.

The watchdog reads it from its own thread to say what a stalled run waits for;
each activity may also be a span of the run's timeline (`timeline.png`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Activity:
    def __init__(self, tracker: Any):
        """`tracker`: the run's `MetricsTracker`, whose timeline gets the spans."""
        self.tracker = tracker
        self.current: tuple[str, float] = ("starting", time.monotonic())
        self._depth = 0

    @contextmanager
    def doing(self, what: str, span: str | None = None) -> Iterator[None]:
        """Mark what the trainer's thread does, and its timeline span. Nested (a sync while
        waiting for a batch), the outer activity comes back after."""
        outer = self.current if self._depth else None
        self.current, self._depth = (what, time.monotonic()), self._depth + 1
        try:
            if span is None:
                yield
            else:
                with self.tracker.span(span):
                    yield
        finally:
            self._depth -= 1
            self.current = outer or (f"done with {what}", time.monotonic())

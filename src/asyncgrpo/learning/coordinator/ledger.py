"""The ledger of group outcomes: where every admitted group went, one record for the run.

A group is admitted by the buffer's throttle and ends exactly once: consumed by
the trainer, dropped at consume time as too stale, or ended early by the
orchestrator with a reason (zero variance, reward error, engine error, ...).
Until then it is in flight (being built) or queued (scored, waiting for a
batch). The ledger counts those ends, and it is the one place that tells the
prompt stream that a group's prompt is finished (`on_end`), so a prompt is
released exactly when its group is counted.

    admitted == consumed + sum(dropped.values()) + queued + in_flight

`dropped` holds every early end by reason, "stale" included; `failures()` is the
same counts without "stale" (the groups that ended before reaching the buffer).
`accounting.json` and each checkpoint hold `record()`; a resumed run `restore`s
it, so the totals and the admission budget (measured against `consumed`) go on
from there.

The ledger has no lock of its own: its owner, `RolloutBuffer`, calls it under
the buffer's lock, which is also what makes a record and the prompt stream's
position consistent (`RolloutBuffer.record`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

STALE = "stale"  # dropped at consume time: older than max_staleness


class GroupLedger:
    def __init__(self, on_end: Callable[[int], None] | None = None):
        """`on_end(position)`: the group of that prompt position has ended (any way)."""
        self.on_end = on_end
        self.admitted = 0
        self.consumed = 0
        self.dropped: Counter[str] = Counter()

    def admit(self) -> None:
        self.admitted += 1

    def consume(self, positions: Iterable[int]) -> None:
        """Groups taken into a batch: trained on, their prompts done."""
        for position in positions:
            self.consumed += 1
            self._ended(position)

    def drop(self, reason: str, position: int | None) -> None:
        """A group ended without training (`position` None: no prompt to release)."""
        self.dropped[reason] += 1
        self._ended(position)

    def _ended(self, position: int | None) -> None:
        if self.on_end is not None and position is not None:
            self.on_end(position)

    def failures(self) -> dict[str, int]:
        """Groups that ended before reaching the buffer, by reason (the drops but `stale`)."""
        return {reason: n for reason, n in self.dropped.items() if reason != STALE}

    def record(self) -> dict[str, Any]:
        """The counts a checkpoint and `accounting.json` keep."""
        return {
            "admitted": self.admitted,
            "consumed": self.consumed,
            "dropped": dict(self.dropped),
            "failures": self.failures(),
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Continue from a checkpoint's `record()`: the groups that ended before it stay
        counted; those then queued or in flight are served again, so they are not carried.

        A record of the older format also listed `failures` on their own; `dropped`
        already held them, so they are not added twice."""
        self.consumed = int(record.get("consumed", 0))
        self.dropped = Counter({k: int(v) for k, v in (record.get("dropped") or {}).items()})
        self.admitted = self.consumed + self.dropped.total()

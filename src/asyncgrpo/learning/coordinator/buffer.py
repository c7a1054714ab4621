"""The rollout buffer: admission throttle, queue of scored groups, drop-at-consume.

It sits between the orchestrator (an asyncio loop producing groups) and the
trainer (a thread consuming batches), so it is thread-safe with one condition
variable, and every state change wakes every waiter: a throttle that reopened
only at the next weight sync would idle the engine.

It owns the run's `GroupLedger` (`ledger.py`): every admitted group ends
exactly once, consumed here, dropped here as too stale, or discarded by the
orchestrator with a reason, and each end is counted there under this buffer's
lock. The queue never overflows and never drops the oldest data silently:
admission bounds `queued + in_flight` (see `staleness.py`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

from asyncgrpo.base.staleness import is_too_stale, may_admit, staleness
from asyncgrpo.learning.coordinator.ledger import STALE, GroupLedger


class VersionedGroup(Protocol):
    """What the buffer needs to know about a group: the version of its oldest token and
    its id, its prompt's position (released when the group ends)."""

    min_version: int
    group_id: int


class BufferClosed(Exception):
    """The buffer was closed while a caller was waiting on it."""


class RolloutBuffer:
    def __init__(
        self,
        batch_groups: int,
        max_staleness: int,
        on_group_end: Callable[[int], None] | None = None,
        max_ahead: int | None = None,
    ):
        """`on_group_end(position)`: a group ended (consumed or dropped): e.g. mark its
        prompt done, so it is never served again."""
        if batch_groups < 1:
            raise ValueError("batch_groups must be >= 1")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.max_ahead = max_ahead  # most groups queued + in flight (see staleness.py)
        self.ledger = GroupLedger(on_group_end)
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._closed = False
        self.engine_version = 0
        self.in_flight = 0
        self.staleness_seen: list[int] = []  # staleness of every consumed group

    @property
    def dropped(self) -> Counter[str]:
        """Groups that ended without training, by reason (a copy of the ledger's counts)."""
        with self._cond:
            return Counter(self.ledger.dropped)

    # ---- producer side -------------------------------------------------------

    def _admissible(self) -> bool:
        return may_admit(
            engine_version=self.engine_version,
            max_staleness=self.max_staleness,
            batch_groups=self.batch_groups,
            consumed=self.ledger.consumed,
            queued=len(self._queue),
            in_flight=self.in_flight,
            max_ahead=self.max_ahead,
        )

    def wait_admit(self, timeout: float | None = None) -> bool:
        """Block until one more group may start; count it in flight. False on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._admissible(), timeout):
                return False
            if self._closed:
                raise BufferClosed
            self.in_flight += 1
            self.ledger.admit()
            return True

    def put(self, group: VersionedGroup) -> None:
        """A group admitted earlier is scored and ready for training."""
        with self._cond:
            self.in_flight -= 1
            self._queue.append(group)
            self._cond.notify_all()

    def discard(self, reason: str, group_id: int | None = None) -> None:
        """A group admitted earlier will never arrive (filtered, failed, ...): count it under
        `reason`, release its quota and its prompt (`group_id`, the prompt's position)."""
        with self._cond:
            self.in_flight -= 1
            self.ledger.drop(reason, group_id)
            self._cond.notify_all()

    def set_engine_version(self, version: int) -> None:
        with self._cond:
            self.engine_version = version
            self._cond.notify_all()

    # ---- consumer side -------------------------------------------------------

    def get_batch(self, trainer_version: int, timeout: float | None = None) -> list:
        """Take the next `batch_groups` fresh groups, dropping (and counting) stale ones;
        the first to be ready, handed over in the order they were admitted (group ids).

        Raises TimeoutError when no full batch arrives within `timeout`, BufferClosed when
        closed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale(trainer_version)
                if len(self._queue) >= self.batch_groups:
                    break
                if self._closed:
                    raise BufferClosed
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"no full batch of {self.batch_groups} groups within {timeout:.0f}s "
                        f"(queued {len(self._queue)}, in flight {self.in_flight})"
                    )
                self._cond.wait(remaining)
            # in admission order, not the order the groups happened to finish: the
            # trainer's float sums follow the batch order, and a fixed seed repeats a run
            # only if they do not depend on timing
            batch = [self._queue.popleft() for _ in range(self.batch_groups)]
            batch.sort(key=lambda g: g.group_id)
            self.ledger.consume(g.group_id for g in batch)
            self.staleness_seen.extend(staleness(trainer_version, g.min_version) for g in batch)
            self._cond.notify_all()
            return batch

    def _drop_stale(self, trainer_version: int) -> None:
        fresh = deque()
        for group in self._queue:
            if is_too_stale(trainer_version, group.min_version, self.max_staleness):
                self.ledger.drop(STALE, group.group_id)  # a stale prompt is not retried
            else:
                fresh.append(group)
        if len(fresh) != len(self._queue):
            self._queue = fresh
            self._cond.notify_all()

    # ---- lifecycle and metrics -----------------------------------------------

    def carry_over(self, record: dict) -> None:
        """Continue from a checkpoint's ledger record (`GroupLedger.restore`)."""
        with self._cond:
            self.ledger.restore(record)
            self._cond.notify_all()

    def record(self, position: Callable[[], Any]) -> tuple[Any, dict]:
        """(`position()`, the ledger's record), taken together under the buffer's lock,
        where every group ends: a group is then either counted and its prompt done, or
        neither (a checkpoint's data position and accounting agree)."""
        with self._cond:
            return position(), self.ledger.record()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def snapshot(self) -> dict:
        """The ledger's counts plus what is queued and in flight now."""
        with self._cond:
            return {
                **self.ledger.record(),
                "queued": len(self._queue),
                "in_flight": self.in_flight,
                "engine_version": self.engine_version,
            }

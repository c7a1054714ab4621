"""Busy intervals of the pipeline's roles, and the overlap ratios computed from them.

The whole point of asyncgrpo is that the engine and the trainer are busy at the
same time. This module records when each role works, as intervals
`(role, start_s, end_s)` in seconds since run start, to `timeline.jsonl`, and
derives the two numbers that show whether the overlap works:

- `engine_busy_ratio`: fraction of a window in which at least one generation
  request was in flight (spans of role "engine"; concurrent requests overlap,
  so spans are merged, never summed).
- `trainer_idle_ratio`: fraction of a window in which the trainer did neither
  compute ("trainer") nor weight publishing ("weight_sync") — i.e. it waited
  for data. In synchronous GRPO this is the generation time; async should
  drive it toward 0.

The ratio functions are pure (intervals in, float out). `Timeline` is the
recorder: `with timeline.span("engine"):` may be entered concurrently from many
tasks and threads; a role is busy while any of its spans is open. Open spans
are cut at every `ratios()` call and written, so a long busy period survives a
`kill -9` up to the last step.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .sinks import JsonlWriter, iter_jsonl

ENGINE, TRAINER, WEIGHT_SYNC = "engine", "trainer", "weight_sync"
TRAINER_BUSY_ROLES = (TRAINER, WEIGHT_SYNC)


@dataclass(frozen=True)
class Interval:
    role: str
    start_s: float
    end_s: float


def merge_intervals(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of `(start, end)` spans as sorted, disjoint spans (touching spans join)."""
    merged: list[list[float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def busy_seconds(spans: Iterable[tuple[float, float]], t0: float, t1: float) -> float:
    """Length of the union of `spans` inside the window [t0, t1]."""
    clipped = ((max(s, t0), min(e, t1)) for s, e in spans)
    return sum(e - s for s, e in merge_intervals(clipped))


def busy_ratio(
    intervals: Iterable[Interval], roles: str | Iterable[str], t0: float, t1: float
) -> float:
    """Fraction of [t0, t1] in which any of `roles` was busy; NaN for an empty window."""
    if t1 <= t0:
        return math.nan
    wanted = {roles} if isinstance(roles, str) else set(roles)
    spans = ((i.start_s, i.end_s) for i in intervals if i.role in wanted)
    return busy_seconds(spans, t0, t1) / (t1 - t0)


def engine_busy_ratio(intervals: Iterable[Interval], t0: float, t1: float) -> float:
    return busy_ratio(intervals, ENGINE, t0, t1)


def trainer_idle_ratio(
    intervals: Iterable[Interval],
    t0: float,
    t1: float,
    busy_roles: Iterable[str] = TRAINER_BUSY_ROLES,
) -> float:
    return 1.0 - busy_ratio(intervals, busy_roles, t0, t1)


def read_timeline(path: str | Path) -> list[Interval]:
    """Intervals from a `timeline.jsonl` file (missing file -> [])."""
    out = []
    for row in iter_jsonl(path):
        try:
            out.append(Interval(str(row["role"]), float(row["start_s"]), float(row["end_s"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


class Timeline:
    """Thread-safe recorder of role busy intervals on a run clock (seconds)."""

    def __init__(self, clock: Callable[[], float], writer: JsonlWriter | None = None):
        self._clock = clock
        self._writer = writer
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, float]] = {}  # role -> (open span count, busy since)
        self._intervals: list[Interval] = []  # recent closed intervals, pruned by ratios()
        self.engine_reports_busy = True  # False: the engine (vLLM) does not say when it works

    @contextlib.contextmanager
    def span(self, role: str) -> Iterator[None]:
        """Mark `role` busy for the duration of the block (re-entrant, concurrent-safe)."""
        self.begin(role)
        try:
            yield
        finally:
            self.end(role)

    def begin(self, role: str) -> None:
        with self._lock:
            count, since = self._open.get(role, (0, 0.0))
            self._open[role] = (count + 1, self._clock() if count == 0 else since)

    def end(self, role: str) -> None:
        with self._lock:
            count, since = self._open.get(role, (0, 0.0))
            if count <= 0:
                raise RuntimeError(f"timeline: end('{role}') without a matching begin")
            if count == 1:
                del self._open[role]
                self._record_locked(role, since, self._clock())
            else:
                self._open[role] = (count - 1, since)

    def record(self, role: str, start_s: float, end_s: float) -> None:
        """Add an interval measured elsewhere (e.g. reported by the engine process)."""
        with self._lock:
            self._record_locked(role, start_s, end_s)

    def ratios(self, since_s: float, until_s: float | None = None) -> dict[str, float]:
        """`trainer_idle_ratio` and `engine_busy_ratio` over [since_s, until_s or now].

        Open spans count up to now (and are cut and written). Windows are meant
        to move forward: intervals ending before `since_s` are forgotten.
        """
        with self._lock:
            now = self._clock()
            for role, (count, since) in list(self._open.items()):
                self._record_locked(role, since, now)
                self._open[role] = (count, now)
            self._intervals = [i for i in self._intervals if i.end_s >= since_s]
            intervals = list(self._intervals)
        t1 = now if until_s is None else until_s
        return {
            "trainer_idle_ratio": trainer_idle_ratio(intervals, since_s, t1),
            "engine_busy_ratio": engine_busy_ratio(intervals, since_s, t1)
            if self.engine_reports_busy
            else math.nan,  # unknown, not idle
        }

    def rebase(self, move_clock: Callable[[], float]) -> None:
        """Atomically run `move_clock()` (which returns the new now), forget recorded
        intervals and restart open spans at the new now. Used when resuming."""
        with self._lock:
            now = move_clock()
            self._intervals.clear()
            self._open = {role: (count, now) for role, (count, _) in self._open.items()}

    def close(self) -> None:
        """Close every open span at the current time."""
        with self._lock:
            now = self._clock()
            for role, (_, since) in self._open.items():
                self._record_locked(role, since, now)
            self._open.clear()

    def _record_locked(self, role: str, start_s: float, end_s: float) -> None:
        if end_s <= start_s:
            return
        interval = Interval(role, float(start_s), float(end_s))
        self._intervals.append(interval)
        if self._writer is not None:
            self._writer.write(
                {"role": role, "start_s": round(start_s, 6), "end_s": round(end_s, 6)}
            )

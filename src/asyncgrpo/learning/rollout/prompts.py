"""The run's prompt stream: epochs, shuffling, unique group ids, exact resume.

Rows are served in a seeded per-epoch order. The position that a checkpoint
saves is the dispatch cursor plus the rows dispatched but not yet trained on
(in flight or queued): resuming serves those again first, so a crash neither
skips nor repeats training data. A group's id is its position (`Orchestrator`), so
ids never repeat across epochs or resumed sessions.
"""

from __future__ import annotations

import random
import threading
from typing import Any


class PromptStream:
    def __init__(self, rows: Any, seed: int, shuffle: bool = True):
        if len(rows) == 0:
            raise ValueError("the training dataset is empty")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = 0  # global position: epoch * len(rows) + offset
        self.pending: dict[int, None] = {}  # dispatched, not yet finished (ordered)
        self._retry: list[int] = []
        self._order_epoch = -1
        self._order: list[int] = []
        self._lock = threading.Lock()  # the trainer thread reads state() for checkpoints

    def _row_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch != self._order_epoch:
            self._order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order[offset]

    def next(self) -> tuple[int, dict]:
        """The next (position, row) to dispatch."""
        with self._lock:
            return self._next()

    def _next(self) -> tuple[int, dict]:
        if self._retry:
            position = self._retry.pop(0)
        else:
            position = self.cursor
            self.cursor += 1
        self.pending[position] = None
        return position, dict(self.rows[self._row_index(position)])

    def done(self, position: int) -> None:
        """The group from this position was trained on or dropped: never serve it again."""
        with self._lock:
            self.pending.pop(position, None)

    @property
    def epoch(self) -> int:
        return self.cursor // len(self.rows)

    def state(self) -> dict:
        with self._lock:
            return {"cursor": self.cursor, "pending": list(self.pending) + self._retry}

    def load_state(self, state: dict) -> None:
        self.cursor = int(state.get("cursor", 0))
        self.pending = {}
        self._retry = sorted(int(p) for p in state.get("pending", []))

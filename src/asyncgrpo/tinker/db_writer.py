"""Writes to the Tinker service's database on a thread of their own.

Recording an operation then costs the request path a queue put, not a commit. Writes that
arrive while a transaction commits go into the next one together, so commits grow fewer as
the load grows (a burst of samples costs one commit, not hundreds). Two kinds of write:

- `write(statement)`: a function of the connection, run in the order given. One the client
  must not hear of before it is durable (a checkpoint, a new model or session) is waited on
  through the future it returns.
- `add(statement, params, key)`: a row for one of the statements the writer was prepared
  with; a batch runs each such statement once over all its rows (executemany: the
  per-statement cost of SQLAlchemy and of the driver is paid once per batch, not per row),
  after the batch's `write`s, in the order the statements were given (an operation's
  submission before its end). Rows with the same `key` for one statement keep only the
  last (a model's latest request time). Used for what nothing else depends on: operations'
  outcomes.

A batch that fails is retried one write per transaction, so one bad write costs only itself;
every failure is logged.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection, Engine

logger = logging.getLogger(__name__)

MAX_BATCH = 1024  # writes per transaction at most
Write = Callable[[Connection], Any]


class BatchWriter:
    """One thread that runs the writes it is given, batched into transactions."""

    def __init__(self, engine: Engine, prepared: tuple = (), max_batch: int = MAX_BATCH):
        """`prepared`: the statements `add` takes, in the order a batch runs them."""
        self._engine = engine
        self._prepared = prepared
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failures = 0  # writes that failed alone
        self.commits = 0
        self._thread = threading.Thread(target=self._run, name="tinker-database", daemon=True)
        self._thread.start()

    def write(self, statement: Write) -> concurrent.futures.Future:
        """Queue `statement(connection)`; its future holds what it returned once committed
        (or its exception)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((statement, done))
        return done

    def add(self, statement, params: dict, key: Any = None) -> None:
        """Queue one row for the prepared `statement` (not waited on)."""
        self._queue.put((self._slot(statement), params, key))

    def _slot(self, statement) -> int:
        for slot, prepared in enumerate(self._prepared):
            if prepared is statement:
                return slot
        raise ValueError("add() takes only the statements the writer was prepared with")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write queued before this call has committed or failed."""
        self.write(lambda _connection: None).result(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stopping = [first], False
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._commit(batch)
            if stopping:
                return

    def _commit(self, batch: list) -> None:
        writes = [item for item in batch if len(item) == 2]
        rows: list[dict] = [{} for _ in self._prepared]  # per statement: key -> params
        for slot, params, key in (item for item in batch if len(item) == 3):
            by_key = rows[slot]
            by_key[key if key is not None else ("row", len(by_key))] = params
        try:
            with self._engine.begin() as connection:
                results = [statement(connection) for statement, _ in writes]
                for statement, by_key in zip(self._prepared, rows):
                    if by_key:
                        connection.execute(statement, list(by_key.values()))
        except Exception as exc:
            if len(batch) > 1:
                for item in batch:
                    self._commit([item])
                return
            self.failures += 1
            logger.error("a write to the Tinker service's database failed: %s", exc)
            if len(batch[0]) == 2:
                batch[0][1].set_exception(exc)
            return
        self.commits += 1
        for (_, done), result in zip(writes, results):
            done.set_result(result)

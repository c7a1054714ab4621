"""The Tinker API's futures: every operation answers with a request id at once, its result
is fetched later by long-polling, and a model's operations run in `seq_id` order.

Why long-polling: the SDK polls `retrieve_future` with no pause between calls and a 45 s
client timeout, so the server holds each poll until the result is ready or about 40 s have
passed, then answers "try again". Why ordering on the server: the SDK submits a large
`forward_backward` as chunks sent concurrently (the first chunk last) and lets the user
queue `optim_step` behind it without waiting, so arrival order says nothing; `seq_id` does.
Why deduplication: the SDK resubmits on 5xx, 408, 409 and 429, so the same
`(model_id, seq_id)` may arrive twice and must map to the one operation already queued.

Request ids name the server process that issued them (`req-<boot>-<n>`), so that after a
restart an id of the process before is known for what it is, never taken for a new
operation's. A journal (`store.TinkerStore`), when given, records each operation as it is
submitted and as it ends, so a restarted server can still answer a poll for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.tinker.errors import TinkerUserError, as_error_body

logger = logging.getLogger(__name__)

LONG_POLL_S = (
    40.0  # under the SDK's 45 s timeout on retrieve_future (each "pending" logs a warning there)
)
KEEP_FINISHED = 4096  # finished results kept for late or repeated polls
_REQUEST_ID = re.compile(r"^req-([0-9a-f]+)-\d+$")


def boot_of(request_id: str) -> str | None:
    """The boot token of the process that issued `request_id`, None if it is not one."""
    match = _REQUEST_ID.match(request_id)
    return match.group(1) if match else None


@dataclass
class Outcome:
    """A finished operation: a JSON result, protobuf bytes, or an error body."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: dict[str, str] | None = None


@dataclass
class _Entry:
    owner: str | None = None  # the session it belongs to
    interruptible: bool = True
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    task: asyncio.Task | None = None


class FutureTable:
    """Request ids → outcomes; submissions with a key seen before get the same request id."""

    def __init__(self, keep_finished: int = KEEP_FINISHED, journal=None, boot: str | None = None):
        """`journal`: told `submitted(request_id, owner, subject, kind, seq_id)` and
        `finished(request_id, outcome)`; `boot`: this process's token in request ids."""
        self.journal = journal
        self.boot = boot or secrets.token_hex(4)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_key: dict[tuple, str] = {}
        self._ids = itertools.count(1)
        self._keep = keep_finished
        self._tasks: set[asyncio.Task] = set()
        self.pending = 0  # submitted, not yet done

    def submit(
        self,
        key: tuple | None,
        work: Callable[[], Awaitable[Outcome]],
        owner: str | None = None,
        interruptible: bool = True,
        kind: str = "operation",
        subject: str | None = None,
        seq_id: int | None = None,
    ) -> str:
        """Start `work` (unless `key` was submitted before) and return its request id.

        `owner`: the session whose end fails it (`fail_owned`); `interruptible`: whether
        that end may also cancel the work (False for work that must not stop halfway, such
        as a weight sync on the engine: it runs on and its result is dropped); `kind`,
        `subject` (the model or sampler) and `seq_id` go to the journal."""
        if key is not None and key in self._by_key:
            return self._by_key[key]
        request_id = f"req-{self.boot}-{next(self._ids)}"
        entry = self._entries[request_id] = _Entry(owner, interruptible)
        if self.journal is not None:
            self.journal.submitted(request_id, owner, subject, kind, seq_id)
        if key is not None:
            self._by_key[key] = request_id
        self.pending += 1
        entry.task = asyncio.get_running_loop().create_task(self._run(request_id, entry, work))
        self._tasks.add(entry.task)
        entry.task.add_done_callback(self._tasks.discard)
        return request_id

    async def _run(
        self, request_id: str, entry: _Entry, work: Callable[[], Awaitable[Outcome]]
    ) -> None:
        try:
            outcome = await work()
        except Exception as exc:  # a user error, a bug or an engine failure: serve on
            if entry.done.is_set():
                return  # failed already (its session ended): whatever came after is moot
            if not isinstance(exc, TinkerUserError):
                logger.exception("tinker operation failed")
            outcome = Outcome(error=as_error_body(exc))
        self._finish(request_id, entry, outcome)

    def _finish(self, request_id: str, entry: _Entry, outcome: Outcome) -> None:
        if entry.done.is_set():
            return
        if self.journal is not None:
            self.journal.finished(request_id, outcome)
        entry.outcome = outcome
        entry.done.set()
        self.pending -= 1
        self._forget_old()

    def fail_owned(self, owner: str, error: dict[str, str]) -> int:
        """Fail every pending operation of `owner` with the body `error`, cancelling the
        interruptible ones (an operation queued behind others then never runs); how many."""
        failed = [
            (rid, e) for rid, e in self._entries.items() if e.owner == owner and not e.done.is_set()
        ]
        for request_id, entry in failed:
            self._finish(request_id, entry, Outcome(error=error))
            if entry.interruptible and entry.task is not None:
                entry.task.cancel()
        return len(failed)

    def pending_owned(self, owner: str) -> int:
        return sum(e.owner == owner and not e.done.is_set() for e in self._entries.values())

    def knows(self, request_id: str) -> bool:
        """Whether `request_id` is held in memory (issued here, not yet forgotten)."""
        return request_id in self._entries

    def owner(self, request_id: str) -> str | None:
        """The session `request_id` belongs to; an unknown id raises `KeyError`."""
        return self._entries[request_id].owner

    async def retrieve(self, request_id: str, wait_s: float = LONG_POLL_S) -> Outcome | None:
        """The outcome, waiting up to `wait_s` for it; None while it is still running.

        An unknown id raises `KeyError`."""
        entry = self._entries[request_id]
        if not entry.done.is_set():
            try:
                await asyncio.wait_for(entry.done.wait(), wait_s)
            except TimeoutError:
                return None
        return entry.outcome

    def _forget_old(self) -> None:
        finished = [rid for rid, e in self._entries.items() if e.done.is_set()]
        for request_id in finished[: max(0, len(finished) - self._keep)]:
            del self._entries[request_id]
        if len(self._by_key) > 4 * self._keep:
            live = set(self._entries)
            self._by_key = {k: rid for k, rid in self._by_key.items() if rid in live}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class SeqOrder:
    """Runs one model's operations in `seq_id` order, one at a time.

    An operation waits until every lower `seq_id` of its model has finished. Sequence
    ids start at 1 per model (the SDK's counter); an operation without one runs at once.
    """

    def __init__(self, first: int = 1):
        self._next = first
        self._turn = asyncio.Condition()
        self.depth = 0  # operations queued or running: the model's queue depth

    async def run(self, seq_id: int | None, work: Callable[[], Awaitable[Any]]) -> Any:
        self.depth += 1
        try:
            return await self._in_turn(seq_id, work)
        finally:
            self.depth -= 1

    async def _in_turn(self, seq_id: int | None, work: Callable[[], Awaitable[Any]]) -> Any:
        if seq_id is None:
            return await work()
        async with self._turn:
            if seq_id < self._next:
                raise TinkerUserError("seq_id", f"seq_id {seq_id} was already used by this model")
            await self._turn.wait_for(lambda: self._next == seq_id)
        try:
            return await work()
        finally:
            async with self._turn:
                self._next = seq_id + 1
                self._turn.notify_all()

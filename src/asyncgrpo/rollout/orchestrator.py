"""The orchestrator: turns prompt rows into scored, version-stamped groups, forever.

It runs on the rollout loop. The producer in `run.py` waits for the buffer's
admission throttle, takes the next prompt row and calls `start_group`, which
starts one task per group; the task asks the
`GroupBuilder` for the scored group and hands it to the buffer, or releases its
quota with a reason (zero variance, reward error or timeout, prompt too long,
engine error, or a builder's own `GroupDropped` reason such as `no_reward`).
Every admitted group ends in exactly one of those places; exceptions are never
swallowed silently: each failure kind is counted and its first occurrence
logged. The groups being built, and since when, are what the watchdog reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import Counter

from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.rollout.builder import GroupBuilder, GroupDropped
from asyncgrpo.rollout.prompts import PromptStream
from asyncgrpo.rollout.rewards import RewardFailure, RewardTimeout

logger = logging.getLogger(__name__)


class Orchestrator:
    """Produces groups from `builder` into a `RolloutBuffer` until stopped."""

    def __init__(
        self,
        builder: GroupBuilder,
        buffer: RolloutBuffer,
        prompts: PromptStream,
        *,
        filter_zero_variance: bool = True,
        max_concurrent_groups: int | None = None,
        on_reward_error: str = "drop_group",
    ):
        self.builder = builder
        self.buffer = buffer
        self.prompts = prompts
        self.filter_zero_variance = filter_zero_variance
        self.on_reward_error = on_reward_error
        self._limit = asyncio.Semaphore(max_concurrent_groups) if max_concurrent_groups else None
        self._next_group_id = 0
        self._tasks: set[asyncio.Task] = set()
        self._building: dict[int, float] = {}  # group id -> when it was started
        self._stopping = False
        self.fatal: BaseException | None = None
        self.failures: Counter[str] = Counter()

    @property
    def generated_tokens(self) -> int:
        return self.builder.generated_tokens

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        self._stopping = True

    def building(self) -> list[tuple[int, float]]:
        """(group id, seconds since it started) of every group being built, oldest first."""
        now = time.monotonic()
        started = sorted(dict(self._building).items(), key=lambda item: item[1])
        return [(group_id, now - t) for group_id, t in started]

    def start_group(self, position: int, row: dict) -> None:
        """Build the group of `row` in a task of its own (the buffer admitted it)."""
        group_id = self._next_group_id
        self._next_group_id += 1
        task = asyncio.create_task(self._run_group(group_id, position, row))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Cancel the groups still building (at shutdown) and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_group(self, group_id: int, position: int, row: dict) -> None:
        self._building[group_id] = time.monotonic()
        try:
            await self._build_and_hand_over(group_id, position, row)
        finally:
            self._building.pop(group_id, None)

    async def _build_and_hand_over(self, group_id: int, position: int, row: dict) -> None:
        outcome = "generation_error"
        try:
            if self._limit:
                async with self._limit:
                    group = await self.builder.build(group_id, position, row)
            else:
                group = await self.builder.build(group_id, position, row)
            if group.zero_variance and self.filter_zero_variance:
                outcome = "zero_variance"
            else:
                self.buffer.put(group)
                return  # the position stays pending until the trainer consumes it
        except asyncio.CancelledError:
            raise  # shutting down: the group stays counted in flight
        except GroupDropped as exc:
            outcome = exc.reason
            if exc.log:
                self._log_first(outcome, exc)
        except RewardFailure as exc:  # reward_error, reward_timeout
            outcome = exc.reason
            self._log_first(outcome, exc)
            if self.on_reward_error == "abort":
                self.fatal = exc
                self.stop()
        except Exception as exc:  # engine errors and bugs: counted and logged, never silent
            self._log_first(outcome, exc)
        self.failures[outcome] += 1
        self.buffer.discard(outcome)
        self.prompts.done(position)

    def _log_first(self, kind: str, exc: BaseException) -> None:
        if self.failures[kind] == 0:
            # these say what happened (and name the function); a traceback would only add noise
            expected = isinstance(exc, GroupDropped | RewardTimeout)
            text = str(exc) if expected else "".join(traceback.format_exception(exc))
            logger.error("first %s (later ones are only counted):\n%s", kind, text)

"""The orchestrator: turns prompt rows into scored, version-stamped groups, forever.

It runs on the rollout loop. The producer in `run/loop.py` waits for the buffer's
admission throttle and calls `start_next`, which takes the next prompt row and
starts one task for its group; the task asks the `GroupBuilder` for the scored
group and hands it to the buffer, or discards it there with a reason (zero
variance, reward error or timeout, prompt too long, engine error, or a
builder's own `GroupDropped` reason such as `no_reward`), which the buffer's
ledger counts. Exceptions are never swallowed silently: each failure kind is
counted and its first occurrence logged. The groups being built, and since
when, are what the watchdog reports.

A run in which every group is dropped would otherwise spin forever (a reward that
always raises, constant rewards, rows without a prompt). `DropStreak` counts the
groups dropped since one last reached the buffer: while failures pile up the
producer backs off before starting the next group (`backoff_s`), so a failure that
costs nothing never loops hot; once the streak is long and old enough, the run
stops with a `NoProgress` error naming the cause, its first error and the fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.rollout.builder import GroupBuilder, GroupDropped
from asyncgrpo.learning.rollout.prompts import PromptStream
from asyncgrpo.learning.rollout.rewards import RewardFailure, RewardTimeout
from asyncgrpo.learning.rollout.types import Group

logger = logging.getLogger(__name__)

# A streak of failed groups (any cause but zero variance) stops the run once it spans this
# many batches (at least ERROR_MIN_GROUPS groups) and ERROR_MIN_S seconds.
ERROR_BATCHES, ERROR_MIN_GROUPS, ERROR_MIN_S = 3, 12, 10.0
# Zero-variance groups are normal on a hard task, so their streak must be much longer.
CONSTANT_BATCHES, CONSTANT_MIN_GROUPS, CONSTANT_MIN_S = 8, 32, 30.0
MAX_BACKOFF_S = 1.0  # the longest pause before a new group while failures pile up

FIXES = {
    "reward_error": "correct the reward function named above, which fails on every group; "
    "`rollout.reward_error_policy: abort` stops at its first error",
    "reward_timeout": "make the reward function faster or raise rollout.reward_timeout_s",
    "missing_prompt": "give every dataset row a 'prompt' column (a string or a list of "
    "chat messages)",
    "no_reward": "make the reward functions return numbers, not None or NaN",
    "prompt_too_long": "shorten the prompts or raise engine.max_model_len",
    "zero_variance": "check the reward functions (a sample is above); if the task is too "
    "hard for the model, make it easier or raise rollout.num_generations or "
    "rollout.temperature (`rollout.filter_zero_variance: false` trains on such groups, "
    "with zero advantage)",
}
DEFAULT_FIX = "see the first error above (and engine.log in the run directory)"


class NoProgress(RuntimeError):
    """Every group of a long streak was dropped: the run cannot train."""


@dataclass
class DropStreak:
    """Groups dropped since one last reached the buffer: per cause, how many and the first
    error; for zero variance, a sample group."""

    batch_groups: int
    causes: Counter[str] = field(default_factory=Counter)
    first_errors: dict[str, str] = field(default_factory=dict)
    constant_sample: Group | None = None
    since: float = 0.0

    def progress(self) -> None:
        self.causes.clear()
        self.first_errors.clear()
        self.constant_sample = None

    def dropped(self, cause: str, error: str, group: Group | None = None) -> None:
        if not self.causes:
            self.since = time.monotonic()
        self.causes[cause] += 1
        self.first_errors.setdefault(cause, error)
        if group is not None and self.constant_sample is None:
            self.constant_sample = group

    @property
    def failures(self) -> int:
        """Dropped groups of the streak that failed (not merely zero variance)."""
        return self.causes.total() - self.causes["zero_variance"]

    def backoff_s(self) -> float:
        """Pause before the next group: none for a lone failure, doubling up to a second."""
        if self.failures < 2:
            return 0.0
        return min(MAX_BACKOFF_S, 0.005 * 2.0 ** min(self.failures, 16))

    def verdict(self) -> str | None:
        """Why the run cannot go on, once the streak is long and old enough; else None."""
        total, age = self.causes.total(), time.monotonic() - self.since
        if not total:
            return None
        cause = self.causes.most_common(1)[0][0]
        need, min_s = self._limits(cause)
        if total < need or age < min_s:
            return None
        counts = ", ".join(f"{c}: {n}" for c, n in self.causes.most_common())
        head = f"no progress: the last {total} groups ({age:.0f} s) were all dropped ({counts})"
        return f"{head}. {self._cause_text(cause)}\nfix: {FIXES.get(cause, DEFAULT_FIX)}"

    def _limits(self, cause: str) -> tuple[int, float]:
        """(groups, seconds) the streak must reach before `cause` stops the run."""
        if cause == "zero_variance":
            return max(CONSTANT_BATCHES * self.batch_groups, CONSTANT_MIN_GROUPS), CONSTANT_MIN_S
        return max(ERROR_BATCHES * self.batch_groups, ERROR_MIN_GROUPS), ERROR_MIN_S

    def _cause_text(self, cause: str) -> str:
        if cause != "zero_variance" or self.constant_sample is None:
            return f"First {cause}: {self.first_errors[cause]}"
        g = self.constant_sample
        lines = [f"  prompt: {_clip(g.row.get('prompt'))}"]
        for r in g.rollouts[:3]:
            lines.append(f"  completion: {_clip(r.text)} -> rewards {r.rewards}")
        return (
            "The rewards are constant: every completion of a group got the same reward, so "
            "there is nothing to learn from. A sample group:\n" + "\n".join(lines)
        )


def _clip(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        self._tasks: set[asyncio.Task] = set()
        self._building: dict[int, float] = {}  # group id -> when it was started
        self._stopping = False
        self._logged: set[str] = set()  # failure kinds whose first occurrence was logged
        self.fatal: BaseException | None = None
        self.streak = DropStreak(buffer.batch_groups)

    @property
    def generated_tokens(self) -> int:
        return self.builder.generated_tokens

    @property
    def failures(self) -> dict[str, int]:
        """Groups that ended before reaching the buffer, by reason (the buffer's ledger)."""
        return self.buffer.snapshot()["failures"]

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        self._stopping = True

    def backoff_s(self) -> float:
        """How long the producer waits before the next group (failures piling up)."""
        return self.streak.backoff_s()

    def building(self) -> list[tuple[int, float]]:
        """(group id, seconds since it started) of every group being built, oldest first."""
        now = time.monotonic()
        started = sorted(dict(self._building).items(), key=lambda item: item[1])
        return [(group_id, now - t) for group_id, t in started]

    def start_next(self) -> None:
        """Start the group of the next prompt row (the buffer admitted it)."""
        self.start_group(*self.prompts.next())

    def start_group(self, position: int, row: dict) -> None:
        """Build the group of `row` in a task of its own (the buffer admitted it).

        Its id is its prompt-stream position: unique over the whole run, resumed sessions
        included, and a row that a resume serves again keeps the id (so the sampling seed)
        of its untrained first dispatch, as an uninterrupted run would sample it."""
        task = asyncio.create_task(self._run_group(position, row))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Cancel the groups still building (at shutdown) and wait for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_group(self, group_id: int, row: dict) -> None:
        self._building[group_id] = time.monotonic()
        try:
            await self._build_and_hand_over(group_id, row)
        finally:
            self._building.pop(group_id, None)

    async def _build_and_hand_over(self, group_id: int, row: dict) -> None:
        outcome, error, group = "generation_error", "", None
        try:
            if self._limit:
                async with self._limit:
                    group = await self.builder.build(group_id, row)
            else:
                group = await self.builder.build(group_id, row)
            if group.zero_variance and self.filter_zero_variance:
                outcome = "zero_variance"
            else:
                self.buffer.put(group)
                self.streak.progress()
                return  # the prompt stays pending until the trainer consumes the group
        except asyncio.CancelledError:
            raise  # shutting down: the group stays counted in flight
        except GroupDropped as exc:
            outcome, error = exc.reason, str(exc)
            if exc.log:
                self._log_first(outcome, exc)
        except RewardFailure as exc:  # reward_error, reward_timeout
            outcome, error = exc.reason, str(exc)
            self._log_first(outcome, exc)
            if self.on_reward_error == "abort":
                self.abort(exc)
        except Exception as exc:  # engine errors and bugs: counted and logged, never silent
            error = f"{type(exc).__name__}: {exc}"
            self._log_first(outcome, exc)
        self.buffer.discard(outcome, group_id)  # the ledger counts it and releases the prompt
        self._count_drop(outcome, error, group)

    def _count_drop(self, outcome: str, error: str, group: Group | None) -> None:
        """Add the drop to the streak; stop the run when the streak says it cannot train."""
        self.streak.dropped(outcome, error, group if outcome == "zero_variance" else None)
        verdict = self.streak.verdict()
        if verdict is not None and self.fatal is None:
            self.abort(NoProgress(verdict))

    def abort(self, exc: BaseException) -> None:
        """Stop producing; the trainer's wait for a batch raises `exc`'s message."""
        self.fatal = exc
        self.stop()

    def _log_first(self, kind: str, exc: BaseException) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            # these say what happened (and name the function); a traceback would only add noise
            expected = isinstance(exc, GroupDropped | RewardTimeout)
            text = str(exc) if expected else "".join(traceback.format_exception(exc))
            logger.error("first %s (later ones are only counted):\n%s", kind, text)

"""The orchestrator: turns prompt rows into scored, version-stamped groups, forever.

One asyncio loop. A dispatcher waits for the buffer's admission throttle, then
starts one task per group: generate `num_generations` completions from the
prompt's token ids (one request, `n` samples sharing one prefill), score them
with the reward functions, and hand the group to the buffer — or release its
quota with a reason (zero variance, reward error, prompt too long, engine error).
Every admitted group ends in exactly one of those places; exceptions are never
swallowed silently: each failure kind is counted and its first traceback logged.

When a weight sync aborts requests in flight (`sync_mode: abort`), the partial
completion is resumed from its own tokens (prompt + partial ids as the new
prompt), keeping the version of every token, as AReaL's interruptible
generation does.

Agent runs pass `build_group` (`rollout/episodes.py`): a group is then made of
whole episodes run through the episode gateway, and a `GroupDropped` it raises
releases the quota under its own reason (`infra_error`, `degenerate`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.client.retry import EngineHTTPError
from asyncgrpo.coordinator.buffer import BufferClosed, RolloutBuffer
from asyncgrpo.rollout.episodes import GroupDropped
from asyncgrpo.rollout.prompts import PromptStream
from asyncgrpo.rollout.types import Group, Rollout

logger = logging.getLogger(__name__)


class RewardFailure(Exception):
    """A reward function raised or returned something unusable for this group."""


@dataclass
class GenerationSettings:
    num_generations: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None


class Orchestrator:
    """Produces groups into a `RolloutBuffer` until stopped."""

    def __init__(
        self,
        *,
        client: Any,
        buffer: RolloutBuffer,
        prompts: PromptStream,
        render: Callable[[Any], list[int]],
        decode: Callable[[list[int]], str],
        score: Callable[[dict, list[Rollout]], Any],
        is_zero_variance: Callable[[list[Rollout]], bool],
        settings: GenerationSettings,
        filter_zero_variance: bool = True,
        max_concurrent_groups: int | None = None,
        on_reward_error: str = "drop_group",
        build_group: Callable[[int, int, dict], Any] | None = None,
    ):
        self.client = client
        self.buffer = buffer
        self.prompts = prompts
        self.render = render
        self.decode = decode
        self.score = score
        self.is_zero_variance = is_zero_variance
        self.settings = settings
        self.filter_zero_variance = filter_zero_variance
        self.on_reward_error = on_reward_error
        self.build_group = build_group or self._build_group  # async (id, position, row) -> Group
        self._limit = asyncio.Semaphore(max_concurrent_groups) if max_concurrent_groups else None
        self._next_group_id = 0
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self.fatal: BaseException | None = None
        self.failures: Counter[str] = Counter()
        self.generated_tokens = 0

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        """Dispatch groups while the throttle admits them; return after `stop()`."""
        try:
            while not self._stopping:
                try:
                    admitted = await asyncio.to_thread(self.buffer.wait_admit, 0.2)
                except BufferClosed:
                    break
                if not admitted:
                    continue
                position, row = self.prompts.next()
                group_id = self._next_group_id
                self._next_group_id += 1
                task = asyncio.create_task(self._run_group(group_id, position, row))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_group(self, group_id: int, position: int, row: dict) -> None:
        outcome = "generation_error"
        try:
            if self._limit:
                async with self._limit:
                    group = await self.build_group(group_id, position, row)
            else:
                group = await self.build_group(group_id, position, row)
            if self.build_group != self._build_group:
                self.generated_tokens += sum(r.num_sampled for r in group.rollouts)
            if group.zero_variance and self.filter_zero_variance:
                outcome = "zero_variance"
            else:
                self.buffer.put(group)
                return  # the position stays pending until the trainer consumes it
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except PromptTooLong:
            outcome = "prompt_too_long"
        except GroupDropped as exc:
            outcome = exc.reason
            self._log_first(outcome, exc)
        except RewardFailure as exc:
            outcome = "reward_error"
            self._log_first(outcome, exc)
            if self.on_reward_error == "abort":
                self.fatal = exc
                self.stop()
        except EngineHTTPError as exc:
            self._log_first(outcome, exc)
        except Exception as exc:  # counted and logged, never swallowed silently
            self._log_first(outcome, exc)
        self.failures[outcome] += 1
        self.buffer.discard(outcome)
        if outcome != "cancelled":
            self.prompts.done(position)

    def _log_first(self, kind: str, exc: BaseException) -> None:
        if self.failures[kind] == 0:
            text = "".join(traceback.format_exception(exc))
            logger.error("first %s (later ones are only counted):\n%s", kind, text)

    async def _build_group(self, group_id: int, position: int, row: dict) -> Group:
        prompt_ids = self.render(row["prompt"])
        rollouts = await self._generate(prompt_ids, group_id)
        group = Group(group_id, position, row, rollouts)
        try:
            await self.score(row, rollouts)
        except Exception as exc:
            raise RewardFailure(str(exc)) from exc
        group.zero_variance = self.is_zero_variance(rollouts)
        return group

    async def _generate(self, prompt_ids: list[int], group_id: int) -> list[Rollout]:
        s = self.settings
        sampling = {"temperature": s.temperature, "top_p": s.top_p}
        seed = None if s.seed is None else (s.seed * 7919 + group_id) % (2**31)
        try:
            completion = await self.client.complete(
                prompt_ids,
                n=s.num_generations,
                max_tokens=s.max_tokens,
                **({"seed": seed} if seed is not None else {}),
                **sampling,
            )
        except EngineHTTPError as exc:
            if exc.status == 400 and "max_model_len" in str(exc):
                raise PromptTooLong(str(exc)) from exc
            raise
        rollouts = []
        for sample in completion.samples:
            ids, logprobs, versions = (
                list(sample.token_ids),
                list(sample.logprobs),
                list(sample.weight_versions),
            )
            finish = sample.finish_reason
            while finish == "abort" and len(ids) < s.max_tokens:
                # interrupted by a weight sync: continue from our own tokens
                more = await self.client.complete(
                    prompt_ids + ids, n=1, max_tokens=s.max_tokens - len(ids), **sampling
                )
                part = more.samples[0]
                ids += part.token_ids
                logprobs += part.logprobs
                versions += part.weight_versions
                finish = part.finish_reason
            self.generated_tokens += len(ids)
            rollouts.append(
                Rollout(prompt_ids, ids, logprobs, versions, finish or "length", self.decode(ids))
            )
        return rollouts


class PromptTooLong(Exception):
    pass


def nan_to_none(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

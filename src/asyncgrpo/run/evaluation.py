"""Held-out evaluation that never blocks training.

Every `eval_steps` (and before the first step, and at the end) the held-out
rows are sampled through the run's `GroupBuilder` (`evaluate`: greedy
completions for single-turn runs, episodes for agent runs) on the rollout loop,
with the weights of the last sync (it waits for one still landing); the result is
logged with the step it started at once it is done. At most one evaluation runs
at a time, and a step the run directory already holds an evaluation of (a
resumed run starts at its checkpoint's step, often one that was evaluated) is
not evaluated again.

Each result says how it sampled (`eval_decoding`: "greedy", or "sampled" for
agent episodes), so plots can say so next to the train reward, which is sampled. With a
`BestKeeper`, the weights of the step an evaluation starts at are copied, and kept if its
result is the best so far (`learning/trainer/best.py`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from asyncgrpo.base.loop_thread import LoopThread
from asyncgrpo.learning.rollout.builder import GroupBuilder
from asyncgrpo.learning.rollout.episodes import EpisodeGroupBuilder
from asyncgrpo.learning.trainer.best import BestKeeper

logger = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        builder: GroupBuilder,
        rows: Any,
        loop: LoopThread,
        tracker: Any,
        *,
        every: int,
        limit: int | None = None,
        repeats: int = 1,
        timeout_s: float = 600.0,
        landed: Callable[[], Awaitable[None]] | None = None,
        best: BestKeeper | None = None,
    ):
        """`landed`: on the loop, waits until the last weight sync started has landed;
        `best`: keeps the weights of the best evaluation (`learning/trainer/best.py`)."""
        self.builder = builder
        self.rows = rows
        self.loop = loop
        self.tracker = tracker
        self.every = every
        self.limit = limit
        self.repeats = repeats  # agent runs: episodes per row (they are sampled)
        self.timeout_s = timeout_s
        self.landed = landed
        self.best = best
        self._running: tuple[int, concurrent.futures.Future] | None = None
        self._last_step: int | None = None

    def maybe_start(self, step: int, final: bool = False) -> None:
        """Log a finished evaluation; start one when `step` is due. `final` waits for it."""
        self.collect(block=final)  # the final evaluation waits for one in flight
        if self.rows is None:
            return
        due = final or step % self.every == 0
        fresh = self._last_step != step and not self.tracker.has_eval(step)
        if self._running is None and due and fresh:
            if self.best is not None:
                self.best.evaluation_started(step)  # the weights this evaluation measures
            self._running = (step, self.loop.submit(self._evaluate(step)))
            self._last_step = step
        if final:
            self.collect(block=True)

    def collect(self, block: bool) -> None:
        """Log the evaluation in flight if it is done (or wait for it with `block`)."""
        if self._running is None:
            return
        step, future = self._running
        if not block and not future.done():
            return
        self._running = None
        try:
            row = self.tracker.log_eval(step, future.result(self.timeout_s))
        except Exception:
            logger.exception("evaluation at step %d failed", step)
            if self.best is not None:
                self.best.evaluation_failed()
            return
        if self.best is not None:
            self.best.evaluation_logged(step, row)

    async def _evaluate(self, step: int) -> dict[str, Any]:
        if self.landed is not None:
            await self.landed()
        count = min(len(self.rows), self.limit or len(self.rows))
        rows = [dict(self.rows[i]) for i in range(count)] * self.repeats
        result = await self.builder.evaluate(rows)
        decoding = "sampled" if isinstance(self.builder, EpisodeGroupBuilder) else "greedy"
        return {**result, "eval_version": step, "eval_decoding": decoding}

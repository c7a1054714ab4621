"""The metric row of one optimizer step: the trainer's numbers plus the pipeline's state.

Besides what the trainer returns (loss, rewards, clip ratios, ...), each row
says how stale the consumed groups were, what the buffer dropped and holds, how
fast the engine generated since the last row, what the rollout builder counted
(episode stop reasons, ...), and how busy each role was (`timeline.ratios`).
A sample of each consumed group goes to `samples.jsonl`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import numpy as np

from asyncgrpo.coordinator.buffer import RolloutBuffer
from asyncgrpo.rollout.builder import GroupBuilder
from asyncgrpo.rollout.types import Group


class StepRows:
    """Builds and logs one row per optimizer step; rates are since the previous row."""

    def __init__(self, tracker: Any, buffer: RolloutBuffer, builder: GroupBuilder):
        self.tracker = tracker
        self.buffer = buffer
        self.builder = builder
        self._last = {"time": time.monotonic(), "t_run": 0.0, "gen_tokens": 0}

    def log(
        self, step: int, metrics: dict[str, Any], groups: list[Group], **extra: Any
    ) -> dict[str, Any]:
        """Write the row of `step` (with `extra` fields such as time_s) and its samples."""
        now = time.monotonic()
        gen_tokens = self.builder.generated_tokens
        dt = max(now - self._last["time"], 1e-9)
        row = {**metrics, "step": step, **extra, **self._pipeline_state(len(groups))}
        row["gen_tokens_per_s"] = (gen_tokens - self._last["gen_tokens"]) / dt
        row.update(self.builder.take_stats())
        row.update(self.tracker.timeline.ratios(self._last["t_run"], self.tracker.elapsed()))
        self._last = {"time": now, "t_run": self.tracker.elapsed(), "gen_tokens": gen_tokens}
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        self.tracker.log_step(step, row)
        self.tracker.log_samples(step, [sample_of(g) for g in groups])
        return row

    def _pipeline_state(self, consumed: int) -> dict[str, Any]:
        snap = self.buffer.snapshot()
        stale = self.buffer.staleness_seen[-consumed:] if consumed else []
        return dict(
            staleness_mean=float(np.mean(stale)) if stale else 0.0,
            staleness_max=int(max(stale)) if stale else 0,
            staleness_counts={str(k): v for k, v in sorted(Counter(stale).items())},
            dropped_stale=snap["dropped"].get("stale", 0),
            dropped=snap["dropped"],
            queue_size=snap["queued"],
            in_flight=snap["in_flight"],
        )


def sample_of(group: Group) -> dict[str, Any]:
    """The first completion of a group, for samples.jsonl."""
    first = group.rollouts[0]
    return {
        "group_id": group.group_id,
        "data_index": group.data_index,
        "min_version": group.min_version,
        "completion": first.text,
        "reward": first.reward,
        "finish_reason": first.finish_reason,
    }

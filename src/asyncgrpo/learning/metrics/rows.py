"""The metric row of one optimizer step: the trainer's numbers plus the pipeline's state.

Besides what the trainer returns (loss, rewards, clip ratios, ...), each row
says how stale the consumed groups were, what the buffer dropped and holds, how
fast the engine generated since the last row, what the rollout builder counted
(episode stop reasons, ...), how busy each role was (`timeline.ratios`), and the
mean of each reward function over the step's completions (`reward/<function>`,
before weighting; None where a function returned None for every completion).

Every consumed group goes to `samples.jsonl` as one line: its prompt and
`samples_per_group` of its completions (all of them by default), each with its
combined reward (`advantages.batch_advantages`, the trainer's own function), its
per-function rewards and its finish reason.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

import numpy as np

from asyncgrpo.base.config import AdvantageConfig
from asyncgrpo.learning.coordinator.buffer import RolloutBuffer
from asyncgrpo.learning.rollout.advantages import batch_advantages
from asyncgrpo.learning.rollout.builder import GroupBuilder
from asyncgrpo.learning.rollout.types import Group


class StepRows:
    """Builds and logs one row per optimizer step; rates are since the previous row.

    `reward_names`: one per entry of `Rollout.rewards`; by default the names of the
    builder's reward functions (`builder.rewards.names`), none for agent episodes.
    `samples_per_group`: completions of each group written to samples.jsonl (None: all).
    `advantage`: how the per-function rewards combine (the recipe's `advantage` section).
    """

    def __init__(
        self,
        tracker: Any,
        buffer: RolloutBuffer,
        builder: GroupBuilder,
        *,
        reward_names: list[str] | None = None,
        samples_per_group: int | None = None,
        advantage: AdvantageConfig | None = None,
    ):
        self.tracker = tracker
        self.buffer = buffer
        self.builder = builder
        runner = getattr(builder, "rewards", None)
        self.reward_names = list(reward_names or getattr(runner, "names", None) or [])
        self.samples_per_group = samples_per_group
        self.advantage = advantage or AdvantageConfig()
        self._last = {"time": time.monotonic(), "t_run": 0.0, "gen_tokens": 0}

    def log(
        self, step: int, metrics: dict[str, Any], groups: list[Group], **extra: Any
    ) -> dict[str, Any]:
        """Write the row of `step` (with `extra` fields such as time_s) and its samples.

        Returns the row plus the last held-out result (`eval_reward_mean`, `eval_step`),
        which the progress line shows but metrics.jsonl keeps on its own eval lines.
        """
        now = time.monotonic()
        gen_tokens = self.builder.generated_tokens
        dt = max(now - self._last["time"], 1e-9)
        row = {**metrics, "step": step, **extra, **self._pipeline_state(len(groups))}
        row.update(reward_means(groups, self.reward_names))
        row["gen_tokens_per_s"] = (gen_tokens - self._last["gen_tokens"]) / dt
        row.update(self.builder.take_stats())
        row.update(self.tracker.timeline.ratios(self._last["t_run"], self.tracker.elapsed()))
        self._last = {"time": now, "t_run": self.tracker.elapsed(), "gen_tokens": gen_tokens}
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        self.tracker.log_step(step, row)
        rewards = iter(batch_advantages(groups, self.advantage).rewards.tolist())
        combined = [[next(rewards) for _ in g.rollouts] for g in groups]
        self.tracker.log_samples(
            step,
            [
                sample_of(g, r, self.reward_names, self.samples_per_group)
                for g, r in zip(groups, combined, strict=True)
            ],
        )
        return {**row, **_held_out(self.tracker.last_eval)}

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


def _held_out(last_eval: dict[str, Any] | None) -> dict[str, Any]:
    if not last_eval:
        return {}
    return {"eval_reward_mean": last_eval.get("eval_reward_mean"), "eval_step": last_eval["step"]}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def reward_means(groups: list[Group], names: list[str]) -> dict[str, float | None]:
    """`{"reward/<name>": mean}` over every completion of `groups` that function scored."""
    out: dict[str, float | None] = {}
    for j, name in enumerate(names):
        scores = [
            r.rewards[j]
            for g in groups
            for r in g.rollouts
            if j < len(r.rewards) and _finite(r.rewards[j])
        ]
        out[f"reward/{name}"] = float(np.mean(scores)) if scores else None
    return out


def sample_of(
    group: Group, rewards: list[float], names: list[str], limit: int | None = None
) -> dict[str, Any]:
    """One samples.jsonl line: the group's prompt and its first `limit` completions (None:
    all), each with its combined reward from `rewards` (one per completion)."""
    rollouts = group.rollouts if limit is None else group.rollouts[:limit]
    return {
        "group_id": group.group_id,
        "min_version": group.min_version,
        "prompt": group.row.get("prompt"),
        "samples": [
            {
                "completion": r.text,
                "reward": reward,
                "rewards": dict(zip(names, r.rewards, strict=False)) if names else r.rewards,
                "finish_reason": r.finish_reason,
                "completion_tokens": len(r.completion_ids),
            }
            for r, reward in zip(rollouts, rewards, strict=False)
        ],
    }

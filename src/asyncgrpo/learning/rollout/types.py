"""What a rollout produces: version-stamped token sequences, grouped per prompt.

Training reads these exact ids and log-probs (never re-tokenised text), and the
coordinator reads `min_version` — the oldest token of the group — to bound and
measure staleness.

Agent episodes (`rollout/episodes.py`) put tool results, later user turns and
template scaffolding inside the completion: those tokens have
`completion_mask` 0, log-prob 0.0 and version −1 (they were not sampled), and
carry no loss; `min_version` ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.base.staleness import min_version


@dataclass
class Rollout:
    """One sampled completion of a prompt."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each completion token
    versions: list[int]  # weight version that sampled each completion token
    finish_reason: str
    text: str
    rewards: list[float | None] = field(default_factory=list)  # one per reward function
    reward: float = float("nan")  # combined reward, set on the trainer's copies (NaN: masked)
    completion_mask: list[int] | None = None  # 1 where sampled (carries loss); None: all ones

    @property
    def min_version(self) -> int:
        return min_version(self.versions)

    @property
    def num_sampled(self) -> int:
        """Completion tokens the engine sampled (the ones that carry loss)."""
        if self.completion_mask is None:
            return len(self.completion_ids)
        return sum(self.completion_mask)


@dataclass
class Group:
    """The `num_generations` rollouts of one prompt, the unit of admission and staleness."""

    # its prompt-stream position: unique over the run (epochs and resumed sessions alike),
    # the prompt the buffer releases when the group ends, and the seed of its sampling
    group_id: int
    row: dict[str, Any]
    rollouts: list[Rollout]
    zero_variance: bool = False

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.rollouts)

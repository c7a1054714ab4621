"""The `GroupBuilder` protocol: how one prompt row becomes one scored group.

The orchestrator knows only this boundary, the buffer, the prompt stream and
its limits, so a new kind of rollout is a new builder, not a new branch in the
dispatch loop. Two builders exist: `SingleTurnBuilder` (`single_turn.py`:
`num_generations` completions of a prompt, scored by reward functions) and
`EpisodeGroupBuilder` (`episodes.py`: whole agent episodes). Both decide "zero
variance" with `advantages.is_zero_variance`, the function the trainer's
advantages come from.
"""

from __future__ import annotations

from typing import Any, Protocol

from asyncgrpo.learning.rollout.types import Group


class GroupDropped(Exception):
    """The group will not be trained on; `reason` is what the buffer counts it as."""

    def __init__(self, reason: str, detail: str = "", log: bool = True):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.log = log  # log the first one of this reason with its traceback


class GroupBuilder(Protocol):
    """Builds scored groups from prompt rows, and evaluates held-out rows the same way."""

    generated_tokens: int
    """Tokens sampled so far (those that carry loss), for the throughput metric."""

    async def build(self, group_id: int, row: dict) -> Group:
        """The scored group of `row` (`group_id`: see `Group.group_id`), or raise
        `GroupDropped` / `RewardFailure` with the reason."""
        ...

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        """Held-out metrics (`eval_reward_mean`, ...) of `rows`, sampled through the same
        path as training, not counted in training."""
        ...

    def take_stats(self) -> dict[str, Any]:
        """Per-step metrics of this builder since the last call (e.g. episode stop reasons)."""
        ...

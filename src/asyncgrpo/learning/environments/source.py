"""What every environment adapter returns to `run/build.py`: an `EpisodeSource`.

Its own module so the adapters (`trl`, `openenv`, `verifiers`) import it without importing
the package's dispatch, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from asyncgrpo.learning.agents.rollout_api import RolloutFn
from asyncgrpo.learning.rollout.episodes import GroupScorer


@dataclass
class EpisodeSource:
    """Where a run's episodes come from (see the `asyncgrpo.learning.environments` docstring)."""

    rollout: RolloutFn
    scorer: GroupScorer | None = None
    train_rows: list[dict] | None = None  # the environment's own dataset, if it has one
    eval_rows: list[dict] | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)  # servers to stop, ...
    scores_with_rewards: bool = False  # the scorer calls the run's reward functions (TRL);
    # otherwise they grade each episode's final reply, as metrics only (as for agent.rollout)

"""Environments users already have, trained unchanged: TRL classes, OpenEnv servers, verifiers.

Each shape becomes an `EpisodeSource`: a rollout function that drives the environment
through the episode gateway (so the trained tokens are the engine's own, and tool or
observation tokens carry no loss), optionally a `GroupScorer` that rewards a whole group
at once, and rows when the environment brings its own dataset. `run/build.py` asks
`episode_source` for one and builds an `EpisodeGroupBuilder` from it; the rest of the
run (buffer, trainer, staleness) does not know where the episodes came from.

- `trl`: `tools=[fn, ...]` and `environment_factory=Cls` with TRL 1.16's semantics.
- `openenv`: an OpenEnv server by URL or by app, one WebSocket session per episode.
- `verifiers`: a verifiers environment: a 0.4 package (its taskset, rewards and `Env`,
  `verifiers_v1*`), or a classic-API one and its rubric where verifiers 0.3 is installed.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.environments.source import EpisodeSource

__all__ = ["EpisodeSource", "episode_source", "wants_source"]


def wants_source(cfg: RunConfig, tools: Any = None, environment_factory: Any = None) -> bool:
    """Whether the run's episodes come from an environment of one of the three shapes."""
    a = cfg.agent
    return bool(tools or environment_factory or a.environment or a.openenv or a.verifiers)


def episode_source(
    cfg: RunConfig,
    *,
    reward_funcs: Any = None,
    tools: list | None = None,
    environment_factory: Any = None,
) -> EpisodeSource:
    """The run's episode source; `reward_funcs` is the run's `RewardRunner` (or None)."""
    a = cfg.agent
    if a.openenv is not None:
        from asyncgrpo.learning.environments.openenv import openenv_source

        return openenv_source(cfg)
    if a.verifiers is not None:
        from asyncgrpo.learning.environments.verifiers import verifiers_source

        return verifiers_source(cfg)
    from asyncgrpo.learning.environments.trl import trl_source

    return trl_source(cfg, reward_funcs, tools, environment_factory)

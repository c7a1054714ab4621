"""TRL's `tools=` and `environment_factory=` as episode sources (not built yet)."""

from __future__ import annotations

from typing import Any

from asyncgrpo.config import ConfigError


def trl_source(cfg: Any, reward_funcs: Any, tools: Any, environment_factory: Any) -> Any:
    raise ConfigError("TRL tools / environment_factory are not supported yet")

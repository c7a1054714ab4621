"""OpenEnv environment servers as episode sources (not built yet)."""

from __future__ import annotations

from typing import Any

from asyncgrpo.config import ConfigError


def openenv_source(cfg: Any) -> Any:
    raise ConfigError("agent.openenv: OpenEnv environments are not supported yet")

"""verifiers environments as episode sources (not built yet)."""

from __future__ import annotations

from typing import Any

from asyncgrpo.config import ConfigError


def verifiers_source(cfg: Any) -> Any:
    raise ConfigError("agent.verifiers: verifiers environments are not supported yet")

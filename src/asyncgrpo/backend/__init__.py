"""The trainer's side of the engine boundary: one `EngineBackend` per kind of engine.

A backend starts (or attaches to) the engine that samples, watches its health,
restarts it when it dies, gives the orchestrator a client, and publishes
weights to it. `make_backend` picks the implementation from `engine.type`:

- `embedded` (`embedded.py`): `asyncgrpo serve` as a supervised child process;
- `external` (`external.py`): a server someone else runs, at `engine.base_url`.
"""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.backend.base import EngineBackend, EngineDied
from asyncgrpo.config import EngineConfig


def make_backend(cfg: EngineConfig, run_dir: Path) -> EngineBackend:
    """The backend of `cfg.type` (not started: call `launch`, then `wait_ready`)."""
    if cfg.type == "embedded":
        from asyncgrpo.backend.embedded import EmbeddedBackend

        return EmbeddedBackend(cfg, log_path=run_dir / "engine.log")
    if cfg.type == "external":
        from asyncgrpo.backend.external import ExternalBackend

        return ExternalBackend(cfg)
    raise ValueError(f"unknown engine.type {cfg.type!r}")


__all__ = ["EngineBackend", "EngineDied", "make_backend"]

"""The trainer's side of the engine boundary: one `EngineBackend` per kind of engine.

A backend starts (or attaches to) the engine that samples, watches its health,
restarts it when it dies, gives the orchestrator a client, and publishes
weights to it. `make_backend` picks the implementation from `engine.type`:

- `embedded` (`embedded.py`): `asyncgrpo serve` as a supervised child process;
- `external` (`external.py`): a server someone else runs, at `engine.base_url`;
- `vllm` (`vllm.py`): a vLLM server, launched or attached to (`asyncgrpo.inference.vllm`).

With `engine.replicas` > 1, `replicas.py` spreads the work over that many
backends of the type and syncs all of them.
"""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.base.config import (
    EmbeddedEngineConfig,
    EngineSettings,
    ExternalEngineConfig,
    VLLMEngineConfig,
)
from asyncgrpo.base.engine_errors import EngineDied
from asyncgrpo.inference.backend.base import EngineBackend


def make_backend(cfg: EngineSettings, run_dir: Path, episodes: bool = False) -> EngineBackend:
    """The backend of `cfg.type` (not started: call `launch`, then `wait_ready`).

    `episodes`: the run's agents need the episode gateway (a vLLM engine then gets one).
    """
    if cfg.replica_count == 1:
        return make_one_backend(cfg, run_dir / "engine.log", episodes=episodes)
    from asyncgrpo.inference.backend.replicas import ReplicaBackend

    return ReplicaBackend(
        [
            make_one_backend(cfg, run_dir / f"engine-{i}.log", i, episodes)
            for i in range(cfg.replica_count)
        ]
    )


def make_one_backend(
    cfg: EngineSettings, log_path: Path, replica: int = 0, episodes: bool = False
) -> EngineBackend:
    """One engine of `cfg.type`; `replica` numbers it among `cfg.replicas`."""
    match cfg:
        case EmbeddedEngineConfig():
            from asyncgrpo.inference.backend.embedded import EmbeddedBackend

            return EmbeddedBackend(cfg, log_path=log_path)
        case ExternalEngineConfig():
            from asyncgrpo.inference.backend.external import ExternalBackend

            return ExternalBackend(cfg)
        case VLLMEngineConfig():
            from asyncgrpo.inference.backend.vllm import VLLMBackend

            return VLLMBackend(cfg, log_path=log_path, replica=replica, episodes=episodes)
    raise ValueError(f"unknown engine.type {cfg.type!r}")


__all__ = ["EngineBackend", "EngineDied", "make_backend", "make_one_backend"]

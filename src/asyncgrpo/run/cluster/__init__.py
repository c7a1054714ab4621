"""`cluster.launcher: ray`: the run's engines and trainer ranks as Ray actors.

Ray is optional (`pip install 'asyncgrpo[ray]'`) and imported only here, when a
recipe asks for it. What runs where:

- this process, the driver, is what `asyncgrpo train` always is: trainer rank 0,
  the orchestrator, rewards, the run directory, metrics and the progress display;
- each engine replica is an `EngineActor` (`engines.py`) that runs the embedded
  engine on its node, bound to the node's address; the driver reaches it over
  HTTP, so agent rollouts and the episode gateway are unchanged;
- trainer ranks 1..N-1 are `RankActor`s (`rank_actors.py`) that join rank 0's process
  group exactly as spawned or torchrun ranks do;
- all of them share one placement group (`placement.py`), one bundle per actor,
  from `cluster.engine_resources` / `cluster.trainer_resources`.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.base.config import ConfigError


def require_ray() -> Any:
    """The `ray` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "cluster.launcher ray needs Ray: pip install 'asyncgrpo[ray]' (or `make test-ray` "
            "in a checkout)"
        ) from None
    return ray

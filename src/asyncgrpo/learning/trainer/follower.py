"""A trainer rank other than 0: load the policy, join rank 0, carry out its commands.

Started by rank 0 for `trainer.num_processes > 1` as
`python -m asyncgrpo.learning.trainer.follower RUN_DIR` (the recipe is the run's
`config.yaml`), or by torchrun / accelerate, where every rank runs `asyncgrpo train`
and `run.train` sends ranks above 0 here. The model directory comes from rank 0, so
every rank loads what rank 0 loaded (a model object passed to the API was saved
into the run directory first).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from asyncgrpo.base.config import RunConfig
from asyncgrpo.learning.trainer.distributed import (
    announce_failure,
    announce_ready,
    join_world,
    leave,
)

logger = logging.getLogger(__name__)


def run_follower(cfg: RunConfig) -> None:
    """Serve rank 0 until it says stop; raises when rank 0 is gone or a collective fails."""
    from asyncgrpo.learning.trainer.build import load_policy, policy_trainer
    from asyncgrpo.learning.trainer.data_parallel import serve

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.trainer.num_threads)
    world = join_world(cfg.trainer.collective_timeout_s)
    try:
        model_dir = _local_model_dir(world.store.get("model_dir").decode(), cfg)
        dtype = getattr(torch, world.store.get("dtype").decode())
        model = load_policy(cfg, model_dir).to(dtype)
        _check_device(model, world.store.get("device").decode())
        core = policy_trainer(cfg, model)
    except Exception as exc:
        announce_failure(world, f"{type(exc).__name__}: {exc}")
        raise
    announce_ready(world)
    try:
        serve(core, world, cfg.trainer.strategy == "fsdp")
    finally:
        leave(world)


def _check_device(model: torch.nn.Module, rank0: str) -> None:
    """Every rank trains on the same kind of device: one backend (NCCL or gloo) for all."""
    here = next(model.parameters()).device.type
    if here != rank0:
        raise RuntimeError(
            f"rank 0 trains on {rank0} but this rank on {here}: give every trainer rank "
            "a GPU, or set trainer.device: cpu"
        )


def _local_model_dir(model_dir: str, cfg: RunConfig) -> str:
    """Rank 0's model directory, or, on a node without it (no shared filesystem), the
    recipe's model name resolved here."""
    if Path(model_dir).is_dir():
        return model_dir
    from asyncgrpo.base.models import resolve_model

    try:
        return str(resolve_model(cfg.model.name_or_path))
    except Exception as exc:
        raise FileNotFoundError(
            f"rank 0's model directory {model_dir} is not on this node, and "
            f"model.name_or_path {cfg.model.name_or_path!r} does not resolve here ({exc}): "
            "share the directory, or name a model every node has"
        ) from None


def main(argv: list[str] | None = None) -> int:
    from asyncgrpo.base.config import load_config

    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_config(str(Path(args[0]) / "config.yaml"))
    try:
        run_follower(cfg)
    except Exception as exc:  # rank 0 is gone, or a collective failed: say so in one line
        logger.error("trainer rank stops: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

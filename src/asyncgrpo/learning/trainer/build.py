"""The policy and the trainer a recipe asks for, on rank 0 and on every other rank.

`load_policy` / `prepare_policy`: the model in float32 on the trainer's device
(`trainer_device`), with gradient checkpointing and a LoRA adapter as configured.
`policy_trainer`: the one-process `PolicyTrainer` of the recipe's `trainer`, `loss` and
`advantage` sections. `make_trainer`: that, or rank 0 of several
(`trainer.num_processes`, or a torchrun / accelerate launch). The other ranks
(`follower.py`) build theirs with the same functions, so every rank trains the same
policy the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from asyncgrpo.base.config import ConfigError, RunConfig
from asyncgrpo.base.config.rollout import GREEDY_BELOW
from asyncgrpo.base.hardware import huge_pages_for_large_tensors, keep_freed_memory
from asyncgrpo.learning.trainer.base import Trainer

logger = logging.getLogger(__name__)


def load_policy(cfg: RunConfig, model_dir: str) -> torch.nn.Module:
    """The model to train, from a directory, in float32, prepared by `prepare_policy`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return prepare_policy(cfg, model)


def huge_pages_early(cfg: RunConfig) -> None:
    """For a CPU trainer, unless `trainer.reuse_freed_memory` is off: this process's large
    tensors on huge pages (`hardware.huge_pages_for_large_tensors`). Call before anything
    allocates a tensor: torch fixes the choice at the first allocation."""
    cpu = _trains_on_cpu(cfg.trainer.device)
    if cpu and cfg.trainer.reuse_freed_memory and huge_pages_for_large_tensors():
        logger.info("large tensors on transparent huge pages (fewer page faults per step)")


def prepare_policy(cfg: RunConfig, model: torch.nn.Module) -> torch.nn.Module:
    """On the trainer's device, with gradient checkpointing and the LoRA adapter, as the
    recipe asks. On a CPU, this process keeps freed memory for reuse from here on, unless
    `trainer.reuse_freed_memory` is off."""
    device = trainer_device(cfg.trainer.device)
    reuse = device.type == "cpu" and cfg.trainer.reuse_freed_memory
    if reuse and keep_freed_memory():
        logger.info("malloc keeps freed memory for reuse (no per-step page faults)")
    model = model.to(device)
    if cfg.trainer.gradient_checkpointing:
        _checkpoint_activations(model)
    if cfg.model.lora is not None:
        from asyncgrpo.learning.trainer.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    return model


def _trains_on_cpu(setting: str) -> bool:
    """Whether `trainer.device` resolves to the CPU."""
    return setting == "cpu" or (setting == "auto" and not torch.cuda.is_available())


def trainer_device(setting: str) -> torch.device:
    """`trainer.device` resolved for this rank: a CUDA GPU (`LOCAL_RANK` mod the GPUs
    this process sees, so ranks of one machine take one GPU each, and a Ray actor given
    one GPU takes that one), or the CPU. It becomes the current CUDA device, which NCCL
    and FSDP2's device mesh use."""
    if _trains_on_cpu(setting):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device is cuda, but torch {torch.__version__} sees no CUDA GPU here: "
            "install a CUDA build of torch, or set trainer.device: cpu"
        )
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _checkpoint_activations(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant: works with
    frozen inputs under LoRA and with the packed forward's keyword arguments)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_trainer(
    cfg: RunConfig,
    model: torch.nn.Module,
    run_dir: Path,
    model_dir: str,
    spawn: Callable[..., None] | None = None,
    host: str = "127.0.0.1",
) -> Trainer:
    """One process, or rank 0 of `trainer.num_processes` (or of a torchrun launch).
    `spawn(world, host, port)` starts the other ranks (default: child processes here; the
    composition root passes a Ray cluster's, `cluster/rank_actors.py`), which reach rank 0's
    store at `host`."""
    from asyncgrpo.learning.trainer.distributed import launched_rank, start_world

    core = policy_trainer(cfg, model)
    logger.info("trainer on %s", core.device)
    launched = launched_rank()
    size = launched[1] if launched else cfg.trainer.num_processes
    if size == 1:
        return core
    from asyncgrpo.learning.trainer.data_parallel import DataParallelTrainer

    logger.info("starting %d trainer ranks (%s)", size, cfg.trainer.strategy)
    param = next(model.parameters())
    timeout = cfg.trainer.collective_timeout_s
    world = start_world(size, run_dir, model_dir, param, timeout, spawn, host)
    trainer = DataParallelTrainer(core, world, cfg.trainer.strategy)
    try:
        trainer.start()
    except BaseException:
        trainer.close()
        raise
    return trainer


def policy_trainer(cfg: RunConfig, model: torch.nn.Module):
    """The one-process trainer of the recipe's `trainer`, `loss` and `advantage` sections."""
    from asyncgrpo.learning.trainer import compiled_layers
    from asyncgrpo.learning.trainer.distributed import launched_rank
    from asyncgrpo.learning.trainer.policy_trainer import PolicyTrainer

    trainer = PolicyTrainer(
        model,
        cfg.trainer,
        cfg.loss,
        cfg.advantage,
        max_steps=cfg.max_steps,
        temperature=cfg.rollout.temperature or 1.0,
        # a greedy engine applies no nucleus: its log-probs are the plain log-softmax
        top_p=cfg.rollout.top_p if cfg.rollout.temperature >= GREEDY_BELOW else 1.0,
        max_completion_length=cfg.rollout.max_tokens,
    )
    launched = launched_rank()
    world = launched[1] if launched else cfg.trainer.num_processes
    hidden = getattr(model.config, "hidden_size", 0)
    # after the trainer is built: its KL reference copies the model, and stays eager
    device, bf16 = trainer.device.type, trainer.bf16_autocast
    if compiled_layers.wanted(cfg.trainer, device, hidden, world, bf16=bf16):
        compiled_layers.compile_layers(model)
    return trainer

"""The `Trainer` protocol: what the training loop needs from whatever trains the policy.

`PolicyTrainer` (`policy_trainer.py`) is the one-process implementation (a LoRA model
included); `data_parallel.DataParallelTrainer` is rank 0 of several processes. The loop in
`run/loop.py` sees only these verbs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from asyncgrpo.learning.rollout.types import Group
from asyncgrpo.learning.trainer.checkpoint import TrainingState


class Trainer(Protocol):
    version: int
    """The policy version: optimizer steps taken (a checkpoint restores it)."""

    gathers_weights: bool
    """Whether `named_weights` gathers shards from other ranks: it then casts before the
    gather (half the bytes for bf16), so a publisher asks it for the engine's dtype. Other
    trainers hand out their own tensors, which a publisher casts while copying them."""

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on a batch of scored groups; its metrics. Bumps `version`."""
        ...

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, state_dict names, cast to `dtype` (the engine's), to publish.
        Without `dtype` the tensors may share the model's storage (tied ones alike)."""
        ...

    def save_checkpoint(self, directory: Path, state: TrainingState) -> Path:
        """Write a complete, resumable checkpoint under `directory`; its path."""
        ...

    def load_checkpoint(self, path: Path) -> TrainingState:
        """Restore a checkpoint written by `save_checkpoint` (version included)."""
        ...

    def close(self) -> None:
        """Release what the trainer started (other ranks); safe after a failure."""
        ...

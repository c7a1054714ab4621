"""What the trainer's primitives take and give: token-level datums, micro-batches, results.

Two front doors train the same model with the same code: `asyncgrpo train`'s GRPO step
and the Tinker API (`forward`, `forward_backward`, `optim_step`). Both describe their
data as `TrainDatum`s, the token ids a model reads plus what each target position needs,
and both hand `PolicyTrainer.forward_backward` a loss function over one packed
`MicroBatch` at a time (the GRPO recipe's is `grpo_loss.py`).

A datum's target positions are `loss_start .. len(tokens) - 1`: position j is predicted
from `tokens[:j]`, so a Tinker datum (model input x of length N, `target_tokens` y of
length N, y[i] predicted from x[:i+1]) is `TrainDatum(x + [y[-1]], loss_start=1,
targets=y)`; with explicit `targets` the last token is never read.

`AdamParams` are Tinker's per-step optimizer numbers (the client passes the learning rate
each step; no schedule applies), with Tinker's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo.learning.trainer.batch import StepTotals
from asyncgrpo.learning.trainer.packing import plan_micro_batches

InputArray = np.ndarray | torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class TrainDatum:
    """One sequence to score or train on, as token ids and per-target-position inputs."""

    tokens: list[int]
    """The whole sequence the model reads, the last target included (never itself an input)."""
    loss_start: int
    """Index of the first target position (>= 1); every position from it on is a target."""
    targets: list[int] | None = None
    """Tokens to predict at the target positions, one each, when they are not the sequence's
    own (`tokens[loss_start:]`); Tinker allows arbitrary `target_tokens`."""
    inputs: dict[str, InputArray] = field(default_factory=dict)
    """Float inputs of the loss, one value per target position (weights, sampler log-probs,
    advantages, ...). The name `mask` is reserved: where it is 0 a position carries no loss
    and is not counted in the loss tokens."""
    advantage: float = 0.0
    """GRPO's per-sequence advantage (the recipe's loss reads it; others ignore it)."""
    group: Hashable | None = None
    """Datums with the same group stay in one micro-batch when it fits the token budget, so
    a shared prompt is computed once; None: planned alone."""

    def __post_init__(self):
        n = len(self.tokens)
        if not 1 <= self.loss_start <= n:
            raise ValueError(f"loss_start is {self.loss_start}, outside 1..{n} (len(tokens))")
        if self.targets is not None and len(self.targets) != self.num_targets:
            raise ValueError(
                f"targets has {len(self.targets)} tokens for {self.num_targets} target positions"
            )
        for name, values in self.inputs.items():
            if len(values) != self.num_targets:
                raise ValueError(
                    f"inputs[{name!r}] has {len(values)} values "
                    f"for {self.num_targets} target positions"
                )

    @property
    def num_targets(self) -> int:
        return len(self.tokens) - self.loss_start


@dataclass
class MicroBatch:
    """One packed micro-batch as a loss function sees it; rows are `datums` in order."""

    datums: list[TrainDatum]
    logprobs: torch.Tensor  # (B, T) fp32 log-probs of the targets, with grad; 0 at padding
    mask: torch.Tensor  # (B, T) float: 1 on target positions whose `mask` input is not 0
    inputs: dict[str, torch.Tensor]  # each (B, T) fp32, padded with 0 (the datums' inputs)
    entropy: torch.Tensor | None = None  # (B, T) fp32, detached, when asked for


LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]
"""A micro-batch's scalar loss (with grad) and float metrics. It normalises by whatever
counts it was built with (a whole step's, so that micro-batches and calls sum to the
step's loss): the trainer only sums what it returns."""


@dataclass
class ForwardBackwardResult:
    """What `forward_backward` did: per-datum log-probs and the sums of its micro-batches."""

    logprobs: list[torch.Tensor]  # per datum, (num_targets,) fp32, detached
    totals: StepTotals  # summed losses, loss tokens, token-weighted metrics
    micro_batches: int  # forwards and backwards run

    @property
    def loss(self) -> float:
        """The sum of the micro-batches' losses."""
        return self.totals.loss

    @property
    def loss_tokens(self) -> float:
        return self.totals.tokens

    @property
    def metrics(self) -> dict[str, float]:
        """Each loss metric's mean over the loss tokens."""
        return self.totals.means()


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's AdamW numbers, Tinker's defaults (`optim_step`)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Clip the gradients to this global norm; 0: no clipping."""

    def __post_init__(self):
        checks = {
            "learning_rate": self.learning_rate >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "eps": self.eps > 0,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ValueError(f"AdamParams.{name} = {value} is out of range")

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Set these numbers on every parameter group of `optimizer`."""
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate
            group["betas"] = (self.beta1, self.beta2)
            group["eps"] = self.eps
            group["weight_decay"] = self.weight_decay


def plan_datums(datums: Sequence[TrainDatum], token_budget: int) -> list[list[int]]:
    """Micro-batches (datum indices) of at most `token_budget` tokens, a group's datums
    together; datums without target positions are left out (nothing to forward)."""
    lengths = [len(d.tokens) for d in datums]
    groups = [d.group if d.group is not None else (_ALONE, i) for i, d in enumerate(datums)]
    plan = plan_micro_batches(lengths, token_budget, groups=groups)
    plan = [[i for i in micro if datums[i].num_targets] for micro in plan]
    return [micro for micro in plan if micro]


_ALONE = object()  # the group key of a datum planned alone


def padded_inputs(datums: Sequence[TrainDatum], device: torch.device) -> dict[str, torch.Tensor]:
    """Each input name's values, right-padded with 0 to (B, T) fp32 on `device`."""
    names = datums[0].inputs.keys() if datums else ()
    for d in datums:
        if d.inputs.keys() != names:
            raise ValueError(
                f"datums carry different inputs: {sorted(names)} and {sorted(d.inputs)}"
            )
    return {
        name: torch.nn.utils.rnn.pad_sequence(
            [torch.as_tensor(d.inputs[name], dtype=torch.float32) for d in datums],
            batch_first=True,
        ).to(device)  # (B, T)
        for name in names
    }

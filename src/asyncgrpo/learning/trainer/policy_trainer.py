"""The trained policy, its optimizer and version, and the primitives every front door uses.

`PolicyTrainer` offers the three verbs the Tinker API names, over token-level datums
(`datums.py`): `forward` (log-probs, no gradient), `forward_backward` (a loss function
per packed micro-batch; gradients accumulate across calls) and `optim_step` (the
recipe's AdamW and schedule, or the client's `AdamParams`). `asyncgrpo train`'s `step`
is their composition: `prepare` the scored groups, `forward_backward` the recipe's loss
over their datums (`grpo_loss.py`), `optim_step`. So both front doors run the same code.

The trainer never re-tokenises: each sequence is the engine's prompt ids plus
its sampled ids, and only the sampled ids carry loss (an agent sample's tool results
and template tokens inside the completion have `completion_mask` 0). Advantages are computed
here, over the whole batch, with the same function the orchestrator used to
flag zero-variance groups, so streaming and batch scoring cannot disagree
(`scale_rewards: batch` needs the batch anyway).

Departures from TRL's GRPOTrainer: one optimizer step per batch (no PPO
epochs), so π_old is the current policy detached (`old_logprobs: current`) and
staleness is corrected by the behaviour weights π_θ/π_engine of `corrections.py`;
`old_logprobs: engine` reproduces TRL's async trainer (ratio against the sampler).
Micro-batches are planned by a token budget and packed without padding; every
loss is normalised by the whole step's counts, so accumulation is exact. Likewise
`loss.trust_region: m2` masks by the whole step's statistic: `step_mask` finds the
mask before the first backward (`trust_region.py`).

`PolicyTrainer` takes the recipe's `trainer`, `loss` and `advantage` sections
(`asyncgrpo.base.config`) as they are, plus the few numbers that live elsewhere in a
recipe (`max_steps`, the sampling temperature, the completion length limit).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from asyncgrpo.base.config import AdvantageConfig, LossConfig, TrainerConfig
from asyncgrpo.base.staleness import staleness
from asyncgrpo.learning.rollout.advantages import batch_advantages
from asyncgrpo.learning.rollout.types import Group, Rollout
from asyncgrpo.learning.trainer.batch import Prepared, StepTotals
from asyncgrpo.learning.trainer.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from asyncgrpo.learning.trainer.datums import (
    AdamParams,
    ForwardBackwardResult,
    LossFn,
    MicroBatch,
    TrainDatum,
    padded_inputs,
    plan_datums,
)
from asyncgrpo.learning.trainer.distributed import all_gather_values
from asyncgrpo.learning.trainer.grpo_loss import PADDING, grpo_datums, grpo_loss
from asyncgrpo.learning.trainer.optimizer import clipped_step, make_adamw
from asyncgrpo.learning.trainer.packing import (
    enable_packed_attention,
    packed_token_logprobs,
    pad_ragged,
)
from asyncgrpo.learning.trainer.reference import make_reference
from asyncgrpo.learning.trainer.trust_region import whole_batch_keep
from asyncgrpo.learning.trainer.varlen import varlen_available


def lr_lambda(trainer: TrainerConfig, max_steps: int):
    """Warmup then constant, linear or cosine decay to 0 at `max_steps`."""
    warmup, schedule = trainer.warmup_steps, trainer.lr_schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, max_steps - warmup)
        progress = min(1.0, progress)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class PolicyTrainer:
    """Owns the trained model, its optimizer and schedule, and the policy version."""

    gathers_weights = False

    def __init__(
        self,
        model: torch.nn.Module,
        trainer: TrainerConfig,
        loss: LossConfig,
        advantage: AdvantageConfig,
        *,
        max_steps: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_completion_length: int | None = None,
    ):
        """`temperature`, `top_p`: the sampler's, so the trainer's log-probs are those of the
        distribution the engine sampled from (`trainer/logprobs.py`); `max_completion_length`:
        dr_grpo's constant length (None: the longest completion of each batch)."""
        self.model = model
        self.trainer_cfg = trainer
        self.loss_cfg = loss
        self.adv_cfg = advantage
        self.max_steps = max_steps
        self.temperature = temperature
        self.top_p = top_p
        self.max_completion_length = max_completion_length
        self.device = next(model.parameters()).device
        self.bf16_autocast = trainer.use_bf16_autocast(self.device.type)
        self.attention = trainer.attention_for(self.device.type, varlen_available())
        enable_packed_attention(model)
        # the KL's reference is the policy as given, before any step (see reference.py)
        self.reference = make_reference(model) if loss.beta > 0 else None
        model.train()
        self.build_optimizer()
        self.version = 0
        self.dp_world_size = 1  # data-parallel ranks (`data_parallel.py` sets it)
        self.gradient_sync = None  # averages gradients over the ranks before a step (ddp)
        self.runner = None  # the sharded root module that runs the packed forward (fsdp)

    def build_optimizer(self) -> None:
        """AdamW and the schedule over the trainable parameters (again after sharding, which
        replaces the parameters)."""
        self.optimizer = make_adamw(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.trainer_cfg.learning_rate,
            weight_decay=self.trainer_cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.trainer_cfg, self.max_steps)
        )

    def autocast(self):
        """The forwards' autocast: bf16 where the recipe asks for it, else nothing."""
        on = self.bf16_autocast
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if on else nullcontext()

    @torch.no_grad()
    def forward(self, datums: Sequence[TrainDatum]) -> list[torch.Tensor]:
        """Per datum, the (num_targets,) fp32 log-probs of its targets; no grad, no state."""
        out = [torch.zeros(0, device=self.device) for _ in datums]
        for micro in plan_datums(datums, self.trainer_cfg.micro_batch_tokens):
            packed = self._packed_logprobs([datums[i] for i in micro], with_entropy=False)
            for i, logprobs in zip(micro, packed.logprobs, strict=True):
                out[i] = logprobs.float()
        return out

    def forward_backward(
        self, datums: Sequence[TrainDatum], loss: LossFn, *, with_entropy: bool = False
    ) -> ForwardBackwardResult:
        """Forward and backward over `datums` in packed micro-batches of at most
        `trainer.micro_batch_tokens` tokens (a group's datums together); gradients
        accumulate, across calls too, until `optim_step`.

        `loss` takes one `MicroBatch` and returns its scalar loss and metrics; the trainer
        backpropagates each and sums them. Normalising is the loss function's job: it
        divides by the counts it was built with, those of the whole optimizer step (all
        calls, all ranks), so that the micro-batches' gradients sum to the step's.
        `with_entropy`: fill `MicroBatch.entropy` (a metric; it costs a little).
        """
        totals = StepTotals()
        logprobs = [torch.zeros(0, device=self.device) for _ in datums]
        plan = plan_datums(datums, self.trainer_cfg.micro_batch_tokens)
        for micro in plan:
            batch = self._micro_batch([datums[i] for i in micro], with_entropy)
            value, metrics = loss(batch)
            value.backward()
            totals.add(value.item(), float(batch.mask.sum()), metrics)
            rows = batch.logprobs.detach()  # (B, T)
            for row, i in enumerate(micro):
                logprobs[i] = rows[row, : datums[i].num_targets]
        return ForwardBackwardResult(logprobs, totals, len(plan))

    def _micro_batch(self, datums: list[TrainDatum], with_entropy: bool) -> MicroBatch:
        """One packed forward (with grad) laid out for the loss: padded (B, T) tensors."""
        packed = self._packed_logprobs(datums, with_entropy)
        logprobs, mask = pad_ragged([lp.float() for lp in packed.logprobs])  # (B, T)
        inputs = padded_inputs(datums, self.device)
        if "mask" in inputs:
            mask = mask * inputs["mask"]  # (B, T)
        entropy = None
        if with_entropy:
            entropy, _ = pad_ragged([e.detach().float() for e in packed.entropy])  # (B, T)
        return MicroBatch(datums, logprobs, mask, inputs, entropy)

    def _packed_logprobs(self, datums: Sequence[TrainDatum], with_entropy: bool):
        targets = [d.targets for d in datums]
        with self.autocast():
            return packed_token_logprobs(
                self.model,
                [d.tokens for d in datums],
                prompt_lengths=[d.loss_start for d in datums],
                temperature=self.temperature,
                top_p=self.top_p,
                with_entropy=with_entropy,
                attention=self.attention,
                runner=self.runner,
                targets=targets if any(t is not None for t in targets) else None,
            )

    def reference_logprobs(self, datums: list[TrainDatum]) -> torch.Tensor | None:
        """(B, T) the KL reference's log-probs of the datums' targets, or None (`beta` 0)."""
        if self.reference is None:
            return None
        with self.autocast():
            ref = self.reference.logprobs(
                [d.tokens for d in datums],
                [d.loss_start for d in datums],
                self.temperature,
                self.top_p,
                self.attention,
                targets=[d.targets for d in datums],
            )
        return pad_ragged(ref)[0]

    def optim_step(self, adam: AdamParams | None = None) -> float:
        """One optimizer step on the accumulated gradients (first averaged over the
        data-parallel ranks); the global gradient norm before clipping. Bumps `version`.

        `adam=None`: the recipe's AdamW, schedule and `max_grad_norm`. `AdamParams` (Tinker's
        `optim_step`): those numbers for this step, no schedule; `grad_clip_norm` 0 clips
        nothing. A trainer is driven by one of the two.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.gradient_sync is not None:
            self.gradient_sync(params)
        if adam is not None:
            adam.apply(self.optimizer)
        clip = self.trainer_cfg.max_grad_norm if adam is None else adam.grad_clip_norm
        grad_norm = clipped_step(self.optimizer, params, clip)
        if adam is None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if hasattr(grad_norm, "full_tensor"):  # a sharded model's norm is a DTensor
            grad_norm = grad_norm.full_tensor()
        return float(grad_norm)

    def step(self, groups: list[Group]) -> dict[str, float]:
        """`asyncgrpo train`'s optimizer step on a batch of scored groups: `prepare`, the
        GRPO loss's `forward_backward` (`accumulate`), `optim_step`; its metrics."""
        start = time.perf_counter()
        batch = self.prepare(groups)
        totals = self.accumulate(batch)
        grad_norm = self.optim_step()
        return self.step_metrics(batch, totals, grad_norm, time.perf_counter() - start)

    def prepare(self, groups: list[Group]) -> Prepared:
        """The batch's samples, advantages and whole-step counts.

        With `loss.mask_truncated_completions`, completions cut off by the length limit
        count in their group's advantages, then are left out of the loss and the counts."""
        scored = batch_advantages(groups, self.adv_cfg)  # every sample, truncated ones too
        rollouts = [
            dataclasses.replace(r, reward=float(reward))  # copies: the groups stay as built
            for r, reward in zip((r for g in groups for r in g.rollouts), scored.rewards)
        ]
        sampled_tokens = sum(r.num_sampled for r in rollouts)
        truncated_out = self.loss_cfg.mask_truncated_completions
        masked = [truncated_out and r.finish_reason == "length" for r in rollouts]
        rollouts = [without_loss(r) if m else r for r, m in zip(rollouts, masked, strict=True)]
        completion_tokens = sum(r.num_sampled for r in rollouts)  # loss tokens only
        counts = dict(
            num_global_tokens=float(max(completion_tokens, 1)),
            num_batch_tokens=float(max(completion_tokens, 1)),
            num_global_sequences=float(max(len(rollouts) - sum(masked), 1)),
            max_completion_length=self.max_completion_length
            or max(len(r.completion_ids) for r in rollouts),
            dp_world_size=self.dp_world_size,
        )
        group_of = [g.group_id for g in groups for _ in g.rollouts]
        return Prepared(
            rollouts, scored.advantages, group_of, counts, sampled_tokens=sampled_tokens
        )

    def accumulate(self, batch: Prepared) -> StepTotals:
        """`forward_backward` of the recipe's loss over `batch` (`grpo_loss.py`)."""
        current = self.trainer_cfg.old_logprobs == "current"
        loss = grpo_loss(self.loss_cfg, batch.counts, current, self.reference_logprobs)
        datums, region_metrics = step_mask(self, batch, grpo_datums(batch))
        result = self.forward_backward(datums, loss, with_entropy=True)
        totals = result.totals
        # sharded ranks all-gather in every forward: each runs the step's most micro-batches
        for _ in range(batch.micro_batches - result.micro_batches):
            totals.merge(self.forward_backward([PADDING], loss, with_entropy=True).totals)
        totals.add_step_metrics(region_metrics)
        return totals

    def plan(self, batch: Prepared) -> list[list[int]]:
        """The micro-batches (rollout indices) of `batch` that have completion tokens."""
        return plan_datums(grpo_datums(batch), self.trainer_cfg.micro_batch_tokens)

    def step_metrics(
        self, batch: Prepared, totals: StepTotals, grad_norm: float, elapsed: float
    ) -> dict[str, float]:
        rollouts = batch.rollouts
        metrics = totals.means()
        started_at = self.version - 1  # the version the step began at: optim_step() bumped it
        metrics.update(
            loss=totals.loss / self.dp_world_size,  # each rank's loss is scaled by the ranks
            grad_norm=grad_norm,
            learning_rate=self.scheduler.get_last_lr()[0],
            **batch_metrics(rollouts, batch.advantages, started_at),
            completion_len_mean=batch.sampled_tokens / len(rollouts),
            train_tokens_per_s=sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
            / elapsed,
            train_step_s=elapsed,
        )
        return metrics

    def named_weights(self, dtype: torch.dtype | None = None):
        """(name, tensor) pairs to publish to the engine: the state_dict, or only the
        LoRA adapter (`lora.py`)."""
        from asyncgrpo.learning.trainer.lora import published_weights

        return published_weights(self.model, dtype)

    def close(self) -> None:
        """Nothing to release in one process (the data-parallel trainer stops its ranks)."""

    def save_checkpoint(self, directory: Path, state: TrainingState) -> Path:
        """Model, optimizer, scheduler and `state` under `directory` (see checkpoint.py)."""
        return save_checkpoint(directory, self.model, self.optimizer, self.scheduler, state)

    def load_checkpoint(self, path: Path) -> TrainingState:
        """Restore a checkpoint in place, the policy version with it."""
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.version = state.version
        return state


def step_mask(
    trainer: PolicyTrainer, batch: Prepared, datums: list[TrainDatum]
) -> tuple[list[TrainDatum], dict[str, float]]:
    """`loss.trust_region: m2`: the step's token mask on `datums` (their `trust_keep`
    input) and its M2 metrics, from a no-grad forward and, with several ranks, every
    rank's squared log-ratios (`trust_region.py`). The datums as they are when the loss
    can compute the mask alone: the step is one micro-batch on one rank, or `clip`."""
    if trainer.loss_cfg.trust_region != "m2":
        return datums, {}
    runs = len(plan_datums(datums, trainer.trainer_cfg.micro_batch_tokens))
    if trainer.dp_world_size == 1 and runs <= 1:
        return datums, {}
    current = trainer.forward(datums)
    for _ in range(batch.micro_batches - runs):  # sharded ranks forward in step
        trainer.forward([PADDING])
    gather = None
    if trainer.dp_world_size > 1:
        device = trainer.device

        def gather(values: torch.Tensor) -> torch.Tensor:  # a collective, on the device
            return all_gather_values(values.to(device)).cpu()

    return whole_batch_keep(datums, current, trainer.loss_cfg.m2_threshold, gather)


def batch_metrics(
    rollouts: list[Rollout], advantages: np.ndarray, trainer_version: int
) -> dict[str, float]:
    """Reward mean and std (NaN-aware, NaN when nothing was scored), mean |advantage|, and
    the per-token staleness against `trainer_version`, the version the step began at."""
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
    scored = np.isfinite(rewards).any()
    return dict(
        reward_mean=float(np.nanmean(rewards)) if scored else float("nan"),
        reward_std=float(np.nanstd(rewards)) if scored else float("nan"),
        advantage_abs_mean=float(np.abs(advantages).mean()),
        **token_staleness(rollouts, trainer_version),
    )


def token_staleness(rollouts: list[Rollout], trainer_version: int) -> dict[str, float]:
    """`token_staleness_mean` / `_max`: `trainer_version` minus the version that sampled
    each token, over the sampled tokens (mask 1, version >= 0); NaN when there are none.

    Unlike the group's `staleness_*` (its oldest token, `metrics/rows.py`), a completion
    that a weight sync split mid-generation counts each token at its own version.
    """
    ages = [
        staleness(trainer_version, version)
        for r in rollouts
        for version, sampled in zip(
            r.versions, r.completion_mask or [1] * len(r.versions), strict=False
        )  # a rollout rebuilt without versions (`Prepared.from_message`) counts none
        if sampled and version >= 0
    ]
    if not ages:
        return dict(token_staleness_mean=float("nan"), token_staleness_max=float("nan"))
    return dict(token_staleness_mean=float(np.mean(ages)), token_staleness_max=float(max(ages)))


def without_loss(rollout: Rollout) -> Rollout:
    """A copy of `rollout` whose tokens carry no loss."""
    return dataclasses.replace(rollout, completion_mask=[0] * len(rollout.completion_ids))

"""`asyncgrpo train`'s step through the trainer's primitives: GRPO datums and loss.

A prepared batch (`batch.Prepared`) becomes one `TrainDatum` per sample: the engine's
prompt ids plus its sampled ids, the loss from the first completion token on, the
behaviour log-probs and the sampled mask as per-token inputs (`engine_logprobs`, `mask`:
an agent sample's tool results and template tokens carry none), the advantage, and the
group id, so a group's samples share their prompt in one packed forward.

`grpo_loss` is the recipe's loss (`losses.compute_loss` over `LossInputs`) as a
`forward_backward` loss function. It closes over the whole step's counts, so every
micro-batch's loss is a term of the step's loss and accumulation is exact; with
`loss.beta > 0` it computes the micro-batch's reference log-probs itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncgrpo.rollout.types import Rollout
from asyncgrpo.trainer.batch import Prepared
from asyncgrpo.trainer.datums import LossFn, MicroBatch, TrainDatum
from asyncgrpo.trainer.losses import LossInputs, compute_loss
from asyncgrpo.trainer.packing import pad_ragged

if TYPE_CHECKING:
    from asyncgrpo.trainer.policy_trainer import PolicyTrainer


def grpo_datums(batch: Prepared) -> list[TrainDatum]:
    """One datum per sample of `batch`, in order."""
    rollouts = batch.rollouts
    width = max((len(r.completion_ids) for r in rollouts), default=0)
    masks = sampled_mask(rollouts, width)  # (B, W)
    return [
        grpo_datum(r, float(advantage), group, masks[i, : len(r.completion_ids)])
        for i, (r, advantage, group) in enumerate(
            zip(rollouts, batch.advantages, batch.group_of, strict=True)
        )
    ]


def grpo_datum(rollout: Rollout, advantage: float, group, mask: torch.Tensor) -> TrainDatum:
    return TrainDatum(
        tokens=rollout.prompt_ids + rollout.completion_ids,
        loss_start=len(rollout.prompt_ids),
        inputs={"engine_logprobs": np.asarray(rollout.logprobs, dtype=np.float32), "mask": mask},
        advantage=advantage,
        group=group,
    )


# a one-token completion that carries no loss: the filler of a sharded rank's extra
# micro-batches (its forward and backward join the others' collectives, its gradient is 0)
PADDING = grpo_datum(
    Rollout([0], [0], [0.0], [], "", "", completion_mask=[0]), 0.0, None, torch.zeros(1)
)


def grpo_loss(trainer: PolicyTrainer, counts: dict[str, float]) -> LossFn:
    """The recipe's loss for micro-batches of `grpo_datums`, normalised by the whole
    step's `counts` (`Prepared.counts`)."""
    current = trainer.trainer_cfg.old_logprobs == "current"

    def loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = batch.logprobs  # (B, T)
        advantages = [d.advantage for d in batch.datums]
        inputs = LossInputs(
            logprobs=logprobs,
            engine_logprobs=batch.inputs["engine_logprobs"],
            advantages=torch.tensor(advantages, dtype=torch.float32, device=logprobs.device),
            mask=batch.mask,
            old_logprobs=logprobs.detach() if current else None,
            ref_logprobs=reference_logprobs(trainer, batch.datums),
            entropy=batch.entropy,
            **counts,
        )
        return compute_loss(inputs, trainer.loss_cfg)

    return loss


def reference_logprobs(trainer: PolicyTrainer, datums: list[TrainDatum]) -> torch.Tensor | None:
    """(B, T) the reference policy's log-probs of the datums' targets (policy layout), or
    None without a reference (`loss.beta` 0)."""
    if trainer.reference is None:
        return None
    with trainer.autocast():
        ref = trainer.reference.logprobs(
            [d.tokens for d in datums],
            [d.loss_start for d in datums],
            trainer.temperature,
            trainer.top_p,
            trainer.attention,
            targets=[d.targets for d in datums],
        )
    return pad_ragged(ref)[0]


def sampled_mask(rollouts: list[Rollout], width: int) -> torch.Tensor:
    """(B, width) 1.0 on completion tokens the engine sampled, 0.0 on inserted ones and padding.

    Agent samples carry tool results and template tokens inside the completion
    (`Rollout.completion_mask` 0, behaviour log-prob 0.0): they are never trained on,
    and the corrections never see their placeholder log-probs.
    """
    masks, _ = pad_ragged(
        [
            r.completion_mask if r.completion_mask is not None else [1] * len(r.completion_ids)
            for r in rollouts
        ]
    )  # (B, T)
    return torch.nn.functional.pad(masks, (0, width - masks.shape[1]))

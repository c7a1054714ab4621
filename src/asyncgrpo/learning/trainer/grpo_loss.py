"""`asyncgrpo train`'s step through the trainer's primitives: GRPO datums and loss.

A prepared batch (`batch.Prepared`) becomes one `TrainDatum` per sample: the engine's
prompt ids plus its sampled ids, the loss from the first completion token on, the
behaviour log-probs and the sampled mask as per-token inputs (`engine_logprobs`, `mask`:
an agent sample's tool results and template tokens carry none), the advantage, and the
group id, so a group's samples share their prompt in one packed forward.

`grpo_loss` is the recipe's loss (`losses.compute_loss` over `LossInputs`) as a
`forward_backward` loss function. It closes over the whole step's counts, so every
micro-batch's loss is a term of the step's loss and accumulation is exact; with
`loss.beta > 0` it asks for the micro-batch's reference log-probs itself. Under
`loss.trust_region: m2` the step's token mask arrives as the datums' `trust_keep`
input when the trainer computed it beforehand (`trust_region.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from asyncgrpo.base.config import LossConfig
from asyncgrpo.learning.rollout.types import Rollout
from asyncgrpo.learning.trainer.batch import Prepared
from asyncgrpo.learning.trainer.datums import LossFn, MicroBatch, TrainDatum
from asyncgrpo.learning.trainer.losses import LossInputs, compute_loss
from asyncgrpo.learning.trainer.packing import pad_ragged


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


def grpo_loss(
    cfg: LossConfig,
    counts: dict[str, float],
    old_is_current: bool,
    reference: Callable[[list[TrainDatum]], torch.Tensor | None],
) -> LossFn:
    """The recipe's loss `cfg` for micro-batches of `grpo_datums`, normalised by the whole
    step's `counts` (`Prepared.counts`). `old_is_current`: π_old is the policy detached
    (`trainer.old_logprobs: current`), else the engine's; `reference(datums)`: the (B, T)
    reference log-probs of a micro-batch for the KL, or None."""

    def loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs = batch.logprobs  # (B, T)
        advantages = [d.advantage for d in batch.datums]
        inputs = LossInputs(
            logprobs=logprobs,
            engine_logprobs=batch.inputs["engine_logprobs"],
            advantages=torch.tensor(advantages, dtype=torch.float32, device=logprobs.device),
            mask=batch.mask,
            old_logprobs=logprobs.detach() if old_is_current else None,
            ref_logprobs=reference(batch.datums),
            entropy=batch.entropy,
            trust_keep=batch.inputs.get("trust_keep"),  # the step's M2 mask, when the
            **counts,  # trainer computed it (trust_region.py)
        )
        return compute_loss(inputs, cfg)

    return loss


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

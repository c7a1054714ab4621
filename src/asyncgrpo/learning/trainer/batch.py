"""A step's batch as the trainer consumes it, and the sums its micro-batches report.

`Prepared` is what remains of the scored groups once the advantages are known: the
token ids, the behaviour log-probs and masks, one advantage per sample, and the
counts of the *whole* step that every loss aggregation normalises by. It is cut
into shares by group for data-parallel ranks and travels to them as JSON
(`message` / `from_message`); the counts travel unchanged, so every rank's loss is a
term of the same global loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from asyncgrpo.learning.rollout.types import Rollout


@dataclass
class Prepared:
    rollouts: list[Rollout]
    advantages: np.ndarray  # (len(rollouts),)
    group_of: list[int]  # the group id of each rollout
    counts: dict[str, float]  # whole-step counts (losses.LossInputs fields)
    micro_batches: int = 0  # run at least this many (sharded ranks must match forwards)
    sampled_tokens: int = 0  # what the engine sampled, loss-masked samples included (metrics)

    def groups(self) -> list[list[int]]:
        """Rollout indices of each group, groups in order of appearance."""
        order: dict[int, list[int]] = {}
        for index, group in enumerate(self.group_of):
            order.setdefault(group, []).append(index)
        return list(order.values())

    def group_tokens(self) -> list[int]:
        """Tokens (prompt + completion) of each group, in `groups()` order."""
        return [
            sum(len(self.rollouts[i].prompt_ids) + len(self.rollouts[i].completion_ids) for i in g)
            for g in self.groups()
        ]

    def subset(self, group_indices: list[int]) -> Prepared:
        """The samples of the groups at `group_indices` (of `groups()`), same counts."""
        groups = self.groups()
        rows = [i for g in group_indices for i in groups[g]]
        return Prepared(
            [self.rollouts[i] for i in rows],
            self.advantages[rows],
            [self.group_of[i] for i in rows],
            self.counts,
            self.micro_batches,
        )

    def message(self, group_indices: list[int]) -> dict:
        """The share at `group_indices` as plain JSON values."""
        part = self.subset(group_indices)
        return {
            "rollouts": [
                [r.prompt_ids, r.completion_ids, r.logprobs, r.completion_mask]
                for r in part.rollouts
            ],
            "advantages": part.advantages.tolist(),
            "group_of": part.group_of,
            "counts": part.counts,
            "micro_batches": self.micro_batches,
        }

    @classmethod
    def from_message(cls, message: dict) -> Prepared:
        rollouts = [
            Rollout(prompt, completion, logprobs, [], "", "", completion_mask=mask)
            for prompt, completion, logprobs, mask in message["rollouts"]
        ]
        return cls(
            rollouts,
            np.asarray(message["advantages"], dtype=np.float64),
            list(message["group_of"]),
            dict(message["counts"]),
            int(message["micro_batches"]),
        )


@dataclass
class StepTotals:
    """Sums over one step's micro-batches; loss metrics weighted by their loss tokens."""

    loss: float = 0.0
    tokens: float = 0.0
    weighted: dict[str, float] = field(default_factory=dict)

    def add(self, loss: float, tokens: float, metrics: dict[str, float]) -> None:
        self.loss += loss
        self.tokens += tokens
        for key, value in metrics.items():
            if value is not None and not math.isnan(value):
                self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens

    def add_step_metrics(self, metrics: dict[str, float]) -> None:
        """Metrics of the whole step, the same on every rank (the M2 trust region's):
        weighted by this rank's loss tokens, so that the merged mean is the value itself."""
        for key, value in metrics.items():
            if not math.isnan(value):
                self.weighted[key] = self.weighted.get(key, 0.0) + value * self.tokens

    def merge(self, other: StepTotals) -> None:
        """Add another rank's sums (its loss is a term of the same global loss)."""
        self.loss += other.loss
        self.tokens += other.tokens
        for key, value in other.weighted.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value

    def means(self) -> dict[str, float]:
        """Token-weighted mean of each metric (NaN values left out)."""
        return {k: v / self.tokens for k, v in self.weighted.items()} if self.tokens else {}

    def as_dict(self) -> dict:
        return {"loss": self.loss, "tokens": self.tokens, "weighted": self.weighted}

    @classmethod
    def from_dict(cls, data: dict) -> StepTotals:
        return cls(float(data["loss"]), float(data["tokens"]), dict(data["weighted"]))

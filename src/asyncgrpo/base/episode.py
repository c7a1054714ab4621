"""What one agent episode leaves for training: its samples, its reward, how it ended.

The episode gateway (`inference/server`) records an episode's calls and turns them
into `BranchSequence`s on the engine's own token ids; the learning side
(`learning/agents`, `learning/rollout`) scores them and trains on them. These
records are the whole of what the two sides share about an episode, so they live
below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from asyncgrpo.base.staleness import min_version


class StopReason(str, Enum):
    OK = "ok"
    MAX_TURNS = "max_turns"
    TIMEOUT = "timeout"
    LENGTH = "length"
    TOOL_ERROR = "tool_error"
    INFRA_ERROR = "infra_error"  # the engine or gateway failed: not the policy's fault
    REWARD_ERROR = "reward_error"  # the reward could not be computed

    @property
    def trainable(self) -> bool:
        """Infrastructure and reward failures say nothing about the policy: never reward 0."""
        return self not in (StopReason.INFRA_ERROR, StopReason.REWARD_ERROR)


@dataclass
class BranchSequence:
    """One training sequence (one branch of an episode)."""

    input_ids: list[int]  # (T,)
    loss_mask: list[int]  # (T,) 1 on sampled tokens only
    logprobs: list[float]  # (T,) behaviour log-probs, 0.0 where masked
    versions: list[int]  # (T,) weight versions, -1 where masked
    branch_index: int
    finish_reason: str = "stop"  # of the branch's last call

    @property
    def min_version(self) -> int:
        return min_version(self.versions)


@dataclass
class EpisodeMetrics:
    turns: int = 0  # calls made
    tool_calls: int = 0  # parsed tool calls returned to the agent
    tool_failures: int = 0  # tool calls that produced an error result
    branches: int = 0  # samples emitted
    malformed_tool_calls: int = 0  # tool-call blocks the parser could not read
    prompt_mismatches: int = 0  # turns whose engine prompt was not the trained prefix


@dataclass
class EpisodeResult:
    reward: float | None
    stop_reason: StopReason
    samples: list[BranchSequence]
    metrics: EpisodeMetrics = field(default_factory=EpisodeMetrics)

    @property
    def trainable(self) -> bool:
        return self.reward is not None and self.stop_reason.trainable and bool(self.samples)

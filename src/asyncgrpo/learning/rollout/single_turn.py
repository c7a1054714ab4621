"""Single-turn groups: `num_generations` completions of one prompt, scored by reward functions.

One request per group asks the engine for `n` samples of the prompt's token
ids, so they share one prefill. When a weight sync aborts requests in flight
(`sync_mode: abort`), a partial completion is resumed from its own tokens
(prompt + partial ids as the new prompt), keeping the version of every token,
as AReaL's interruptible generation does. Evaluation samples greedily through
the same `_sample` path, one completion per held-out row.

A group in which fewer than two completions got any reward (every function
returned None or NaN for them) carries no signal and is dropped as `no_reward`,
not as `zero_variance`: the rewards are missing, not equal.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from asyncgrpo.base.config import AdvantageConfig
from asyncgrpo.base.config.sampling import SamplingSettings
from asyncgrpo.base.engine_errors import EngineRefused
from asyncgrpo.learning.rollout.advantages import is_zero_variance
from asyncgrpo.learning.rollout.builder import GroupDropped
from asyncgrpo.learning.rollout.data import render_prompt
from asyncgrpo.learning.rollout.rewards import RewardFailure
from asyncgrpo.learning.rollout.types import Group, Rollout


class SingleTurnBuilder:
    """Render, generate, decode, score: one prompt row into one scored group."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        rewards: Any,
        sampling: SamplingSettings,
        advantage: AdvantageConfig,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.rewards = rewards  # a RewardRunner
        self.sampling = sampling
        self.advantage = advantage
        self.generated_tokens = 0

    def render(self, prompt: Any) -> list[int]:
        """The prompt's token ids, left-truncated to `max_prompt_length` (the end is kept)."""
        ids = render_prompt(self.tokenizer, prompt)
        keep = self.sampling.max_prompt_length
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def build(self, group_id: int, row: dict) -> Group:
        if "prompt" not in row:
            raise GroupDropped(
                "missing_prompt",
                f"a dataset row has no 'prompt' column (its columns: {', '.join(row) or '-'})",
            )
        rollouts = await self._sample(self.render(row["prompt"]), self.sampling, group_id)
        self.generated_tokens += sum(len(r.completion_ids) for r in rollouts)
        group = Group(group_id, row, rollouts)
        await self.score(row, rollouts)
        self._require_rewards(rollouts)
        group.zero_variance = is_zero_variance(rollouts, self.advantage)
        return group

    async def score(self, row: dict, rollouts: list[Rollout]) -> None:
        try:
            per_function = await self.rewards.score_group(
                row, [r.text for r in rollouts], [r.completion_ids for r in rollouts]
            )
        except RewardFailure:
            raise
        except Exception as exc:
            raise RewardFailure(str(exc)) from exc
        for i, r in enumerate(rollouts):
            r.rewards = [scores[i] for scores in per_function]

    def _require_rewards(self, rollouts: list[Rollout]) -> None:
        """`GroupDropped("no_reward")` when fewer than two completions have any reward."""
        scored = sum(any(x is not None for x in r.rewards) for r in rollouts)
        if scored >= 2:
            return
        silent = [
            name
            for j, name in enumerate(self.rewards.names)
            if all(r.rewards[j] is None for r in rollouts)
        ]
        raise GroupDropped(
            "no_reward",
            f"the reward functions returned None or NaN for {len(rollouts) - scored} of "
            f"{len(rollouts)} completions (None/NaN for all: {', '.join(silent) or '-'})",
        )

    async def _sample(
        self, prompt_ids: list[int], s: SamplingSettings, group_id: int | None
    ) -> list[Rollout]:
        """`s.n` completions of the prompt; seeded per group when `group_id` is given."""
        try:
            completion = await self.client.complete(prompt_ids, **s.request_fields(group_id))
        except EngineRefused as exc:
            if exc.status == 400 and "max_model_len" in str(exc):
                raise GroupDropped("prompt_too_long", str(exc), log=False) from exc
            raise
        rollouts = []
        for sample in completion.samples:
            ids, logprobs = list(sample.token_ids), list(sample.logprobs)
            versions, finish = list(sample.weight_versions), sample.finish_reason
            while finish == "abort" and len(ids) < s.max_tokens:
                # interrupted by a weight sync: continue from our own tokens
                rest = s.continuing(len(ids))
                more = await self.client.complete(prompt_ids + ids, **rest.request_fields())
                part = more.samples[0]
                ids += part.token_ids
                logprobs += part.logprobs
                versions += part.weight_versions
                finish = part.finish_reason
            rollouts.append(
                Rollout(prompt_ids, ids, logprobs, versions, finish or "length", self.decode(ids))
            )
        return rollouts

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        """Greedy completions of every held-out row, scored by the reward functions."""
        greedy = self.sampling.greedy()
        versions: set[int] = set()

        async def one(row: dict) -> list[float | None]:
            (rollout,) = await self._sample(self.render(row["prompt"]), greedy, None)
            versions.update(rollout.versions)
            await self.score(row, [rollout])
            return rollout.rewards

        scores = await asyncio.gather(*[one(r) for r in rows])
        weights = self.advantage.reward_weights or [1.0] * len(scores[0])
        totals = [
            sum(w * s for w, s in zip(weights, row, strict=True) if s is not None) for row in scores
        ]
        return {
            "eval_reward_mean": float(np.mean(totals)),
            "eval_count": len(totals),
            # the weights that actually answered (a sync may land during an evaluation)
            "eval_weight_version_min": min(versions, default=None),
            "eval_weight_version_max": max(versions, default=None),
        }

    def take_stats(self) -> dict[str, Any]:
        return {}

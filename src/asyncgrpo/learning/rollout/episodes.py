"""Groups of agent episodes: `num_generations` runs of one task through the episode gateway.

With `agent.rollout` set, the orchestrator builds each group here instead of
sampling `n` completions of a prompt: the user's `async def rollout(task, llm)`
runs `num_generations` times concurrently (`agents.runner.run_episode`), each
episode against its own gateway endpoint, and every recorded branch becomes a
`Rollout` on the engine's exact token ids (`training_row`): the prompt is
everything before the first sampled token, the completion the rest, with tool
results and template tokens at `completion_mask` 0.

What each stop reason does to the group (nothing becomes reward 0 silently):

- trainable episodes (a reward, `ok`/`max_turns`/... with a `failure_rewards`
  entry) give all their branches the episode's reward;
- `infra_error` (engine down, 5xx, an expired episode) is not the policy's
  fault: the episode is run again, at most `max_infra_retries` times, then the
  whole group is dropped (reason `infra_error`);
- any other untrainable episode (`reward_error`, a timeout without a failure
  reward, ...) is masked: its samples are left out of the group, exactly as if
  their loss mask were all 0 (they would have advantage 0 and only dilute the
  token-mean normalisation);
- fewer than two trainable episodes: no group-relative signal, the group is
  dropped (`degenerate`); all trainable rewards equal: `zero_variance`.

A `GroupScorer` (TRL reward functions over environment instances, a verifiers
rubric) gives the rewards instead of the rollout: once every episode of a group
has ended, it scores those that ended `ok`, `max_turns` or `length` together, one
value per reward name each (the names are the run's reward columns, weighted by
`advantage.reward_weights`). The rollout then returns no reward, only its
`Result.context` for the scorer. A scorer that raises drops the group
(`reward_error`).

Without a scorer, `rewards:` functions, when a recipe lists them, do not change the reward: they
grade each trainable episode's final reply text (TRL signature, the row's
columns) and are logged as `final_<name>` (`eval_final_<name>` in evaluations),
e.g. a plain correctness check beside a rollout's shaped reward. A grader that
raises or misses `rollout.reward_timeout_s` drops the group (`reward_error`,
`reward_timeout`) like a reward function of a single-turn run.

Departure, stated: advantages are computed per rollout (`compute_advantages`),
so an episode that forked into several branches contributes one rollout per
branch, all with the episode's reward: it weighs more in its group's mean and
std, and its advantage is applied to every branch. The gateway prefills each
turn with the branch's own tokens, so branches only appear when an agent edits
its history (or asks for `n > 1`); the `branches_per_episode` metric shows how
often.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncgrpo.base.config import AdvantageConfig
from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.runner import EpisodeOutcome, run_episode, training_row
from asyncgrpo.learning.rollout.advantages import is_zero_variance
from asyncgrpo.learning.rollout.builder import GroupDropped
from asyncgrpo.learning.rollout.types import Group, Rollout

__all__ = [
    "EpisodeGroupBuilder",
    "EpisodeSettings",
    "GroupDropped",
    "GroupScorer",
    "import_dotted",
    "load_rollout",
]

logger = logging.getLogger(__name__)


@dataclass
class EpisodeSettings:
    num_generations: int
    max_turns: int | None = None
    episode_timeout_s: float | None = None
    call_timeout_s: float | None = None
    max_infra_retries: int = 2
    failure_rewards: dict[str, float] = field(default_factory=dict)
    retry_delay_s: float = 1.0  # before re-running an episode after an infra_error (× attempt)
    scored_by_group: bool = False  # a GroupScorer gives the rewards, not the rollout

    def episode_kwargs(self) -> dict[str, Any]:
        return dict(
            max_turns=self.max_turns,
            episode_timeout_s=self.episode_timeout_s,
            call_timeout_s=self.call_timeout_s,
            failure_rewards=self.failure_rewards,
            scored_by_group=self.scored_by_group,
        )


class GroupScorer(Protocol):
    """Rewards for a group's finished episodes, computed together (see the module docstring)."""

    names: list[str]
    """The reward columns, one value per name for each episode."""

    async def score(self, row: dict, outcomes: list[EpisodeOutcome]) -> list[list[float | None]]:
        """One list per outcome (`outcome.context` is what its rollout returned), each with
        a float or None per name; raise to drop the group."""
        ...


SCORED_STOPS = (StopReason.OK, StopReason.MAX_TURNS, StopReason.LENGTH)


def import_dotted(path: str) -> Any:
    """The object at `package.module:name` (`name` may be dotted), the module found like
    `python -m` finds it: installed packages first, then the working directory (so
    `examples.calculator_agent:rollout` works from the repository root). Raises
    ImportError or AttributeError."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        if os.getcwd() in sys.path:
            raise
        sys.path.append(os.getcwd())
        module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def load_rollout(path: str) -> Callable[..., Awaitable[Any]]:
    """The `async def rollout(task, llm)` at `package.module:function` (`import_dotted`)."""
    try:
        fn = import_dotted(path)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"agent.rollout: cannot load {path!r}: {exc}") from exc
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"agent.rollout: {path!r} must be an `async def rollout(task, llm)`")
    return fn


class EpisodeStats:
    """Counters of finished episodes, read (and reset) once per logged step; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.episodes = 0
        self.turns = self.tool_calls = self.tool_failures = self.branches = 0
        self.malformed_tool_calls = self.infra_retries = 0
        self.stop_reasons: Counter[str] = Counter()
        self.grades: dict[str, list[float]] = {}

    def add(self, outcome: EpisodeOutcome) -> None:
        m = outcome.metrics
        with self._lock:
            self.episodes += 1
            self.turns += m.turns
            self.tool_calls += m.tool_calls
            self.tool_failures += m.tool_failures
            self.branches += m.branches
            self.malformed_tool_calls += m.malformed_tool_calls
            self.stop_reasons[outcome.stop_reason.value] += 1

    def graded(self, name: str, values: list[float]) -> None:
        with self._lock:
            self.grades.setdefault(name, []).extend(values)

    def retried(self) -> None:
        with self._lock:
            self.infra_retries += 1

    def take(self) -> dict[str, Any]:
        """Per-episode means and stop-reason counts since the last call."""
        with self._lock:
            n = max(self.episodes, 1)
            out = {
                "episodes": self.episodes,
                "turns_per_episode": self.turns / n,
                "tool_calls_per_episode": self.tool_calls / n,
                "tool_failures_per_episode": self.tool_failures / n,
                "malformed_tool_calls_per_episode": self.malformed_tool_calls / n,
                "branches_per_episode": self.branches / n,
                "episode_infra_retries": self.infra_retries,
                "stop_reasons": dict(self.stop_reasons),
                **{f"final_{k}": sum(v) / len(v) for k, v in self.grades.items() if v},
            }
            self._reset()
        return out


class EpisodeGroupBuilder:
    """Builds a `Group` from `num_generations` concurrent episodes of one task row."""

    def __init__(
        self,
        client: Any,
        rollout_fn: Callable[..., Awaitable[Any]],
        settings: EpisodeSettings,
        decode: Callable[[list[int]], str],
        run: Callable[..., Awaitable[EpisodeOutcome]] | None = None,
        graders: Any = None,
        advantage: AdvantageConfig | None = None,
        scorer: GroupScorer | None = None,
    ):
        self.client = client
        self.rollout_fn = rollout_fn
        self.settings = settings
        self.decode = decode
        self.run = run  # None: `run_episode` (tests pass a fake, or wrap it)
        self.graders = graders  # a RewardRunner over final replies (metrics only), or None
        self.advantage = advantage or AdvantageConfig()
        self.scorer = scorer
        self.rewards = scorer  # its `names` are the run's reward columns (metrics read them)
        self.stats = EpisodeStats()
        self.generated_tokens = 0

    def take_stats(self) -> dict[str, Any]:
        return self.stats.take()

    async def build(self, group_id: int, row: dict) -> Group:
        """The group of `row`, or `GroupDropped` (infra_error, degenerate)."""
        running = [
            asyncio.ensure_future(self.episode(row)) for _ in range(self.settings.num_generations)
        ]
        try:
            outcomes = await asyncio.gather(*running)
        except BaseException:  # one dropped (or cancelled): stop its siblings, close theirs
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise
        await self.score(row, outcomes)
        trainable = [o for o in outcomes if o.trainable]
        if len(trainable) < 2:
            reasons = Counter(o.stop_reason.value for o in outcomes)
            raise GroupDropped("degenerate", f"{len(trainable)} trainable episodes: {reasons}")
        await self.grade(row, trainable, self.stats)
        rollouts = [r for o in trainable for r in self.rollouts_of(o)]
        self.generated_tokens += sum(r.num_sampled for r in rollouts)
        group = Group(group_id, row, rollouts)
        group.zero_variance = is_zero_variance(rollouts, self.advantage)
        return group

    async def episode(self, row: dict, stats: EpisodeStats | None = None) -> EpisodeOutcome:
        """One episode, run again after an infrastructure failure (bounded)."""
        stats = stats or self.stats
        for attempt in range(self.settings.max_infra_retries + 1):
            if attempt:
                stats.retried()
                await asyncio.sleep(self.settings.retry_delay_s * attempt)
            outcome = await (self.run or run_episode)(
                self.client, self.rollout_fn, row, **self.settings.episode_kwargs()
            )
            stats.add(outcome)
            if outcome.stop_reason != StopReason.INFRA_ERROR:
                return outcome
            logger.warning("episode infra_error (attempt %d): %s", attempt + 1, outcome.error)
        raise GroupDropped(
            "infra_error", f"an episode failed {self.settings.max_infra_retries + 1} times"
        )

    async def score(self, row: dict, outcomes: list[EpisodeOutcome]) -> None:
        """Set the rewards of the episodes the scorer scores (no scorer: nothing to do)."""
        scored = [o for o in outcomes if o.stop_reason in SCORED_STOPS and o.samples]
        if self.scorer is None or not scored:
            return
        try:
            values = await self.scorer.score(row, scored)
            if len(values) != len(scored):
                raise ValueError(f"{len(values)} reward rows for {len(scored)} episodes")
        except (GroupDropped, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise GroupDropped("reward_error", f"{type(exc).__name__}: {exc}") from exc
        weights = self.advantage.reward_weights or [1.0] * len(self.scorer.names)
        for outcome, vector in zip(scored, values, strict=True):
            outcome.rewards = [None if v is None else float(v) for v in vector]
            pairs = zip(weights, outcome.rewards, strict=True)
            present = [(w, v) for w, v in pairs if v is not None and not math.isnan(v)]
            outcome.reward = sum(w * v for w, v in present) if present else None

    async def grade(self, row: dict, outcomes: list[EpisodeOutcome], stats: EpisodeStats) -> None:
        """Score each episode's final reply with the `rewards:` functions, as metrics only."""
        if self.graders is None or not outcomes:
            return
        finals = [final_reply_ids(o) for o in outcomes]
        scores = await self.graders.score_group(row, [self.decode(f) for f in finals], finals)
        for name, values in zip(self.graders.names, scores, strict=True):
            stats.graded(name, [v for v in values if v is not None])

    def rollouts_of(self, outcome: EpisodeOutcome) -> list[Rollout]:
        """One `Rollout` per branch, on the recorded ids, all with the episode's reward."""
        out = []
        for sample in outcome.samples:
            if 1 not in sample.loss_mask:
                continue  # nothing sampled on this branch (cannot happen with real calls)
            t = training_row(sample)
            out.append(
                Rollout(
                    prompt_ids=t["prompt_ids"],
                    completion_ids=t["completion_ids"],
                    logprobs=t["logprobs"],
                    versions=t["versions"],
                    finish_reason=sample.finish_reason,
                    text=self.decode(t["completion_ids"]),
                    rewards=outcome.rewards or [outcome.reward],
                    completion_mask=t["completion_mask"],
                )
            )
        return out

    async def evaluate(self, rows: list[dict]) -> dict[str, Any]:
        """One episode per held-out row (sampled as the rollout samples; not counted in training).

        `eval_reward_mean` is over the trainable episodes; numeric entries of the
        rollouts' `Result.info` are averaged as `eval_<key>` (e.g. a `correct` flag
        next to a shaped reward), stop reasons counted as `eval_stop_reasons`.
        """
        stats = EpisodeStats()

        async def one(row: dict) -> EpisodeOutcome | None:
            try:
                return await self.episode(row, stats)
            except GroupDropped:
                return None

        done = await asyncio.gather(*[one(r) for r in rows])
        for row, o in zip(rows, done, strict=True):
            if o is not None:
                with contextlib.suppress(GroupDropped):  # unscored: left untrainable
                    await self.score(row, [o])
            if o is not None and o.trainable:
                await self.grade(row, [o], stats)
        outcomes = [o for o in done if o is not None]
        rewards = [o.reward for o in outcomes if o.trainable]
        info: dict[str, list[float]] = {}
        for o in outcomes:
            for key, value in o.info.items():
                if isinstance(value, int | float):  # bools too: fractions
                    info.setdefault(key, []).append(float(value))
        summary = stats.take()
        return {
            "eval_reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "eval_count": len(rewards),
            "eval_untrainable": len(outcomes) - len(rewards),
            "eval_turns_per_episode": summary["turns_per_episode"],
            "eval_tool_calls_per_episode": summary["tool_calls_per_episode"],
            "eval_stop_reasons": summary["stop_reasons"],
            **{f"eval_{k}": sum(v) / len(v) for k, v in info.items()},
            **{f"eval_{k}": v for k, v in summary.items() if k.startswith("final_")},
        }


def final_reply_ids(outcome: EpisodeOutcome) -> list[int]:
    """The sampled ids of the episode's last reply (the last run of loss-carrying tokens)."""
    if not outcome.samples:
        return []
    sample = outcome.samples[-1]
    end = len(sample.loss_mask)
    while end and not sample.loss_mask[end - 1]:
        end -= 1
    start = end
    while start and sample.loss_mask[start - 1]:
        start -= 1
    return sample.input_ids[start:end]

"""The word-budget environment ported to verifiers 0.4, for `environment_overhead.py`.

`examples/verifiers_word_budget.py` is a classic-API `MultiTurnEnv`, which verifiers 0.4
cannot load; this is the same environment written against `verifiers.v1`, as a verifiers
user ports one: a taskset (its tasks built in code, the same rows from the same seed), a
task whose `@vf.reward` is `word_budget`, and an `Env` whose `run` plays the two turns
("Describe cats in exactly 4 words." — the reply — "Now describe the sea in exactly 6
words." — the reply). verifiers imports an environment by its top-level module's name, so
the benchmark names this one `word-budget-v1` with `benchmarks/` on the import path.

Where it departs from the classic example: no `shortest_exact_bonus`. verifiers 0.4 scores
each trace alone (no group-level reward), and the native rollout the benchmark compares
against leaves that term out too. The reward arithmetic (`closeness`, `budget_score`) is
a function of the replies' texts, shared with that native rollout.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf
from pydantic import BaseModel

__all__ = ["WordBudgetEnv", "WordBudgetTaskset"]

TOPICS = (
    "cats", "dogs", "the sea", "rain", "coffee", "music", "trees", "the moon", "bread",
    "winter", "trains", "birds", "books", "snow", "the sun", "apples", "rivers", "friends",
    "summer", "mountains", "tea", "cities", "flowers", "clouds", "horses", "fire", "stars",
)  # fmt: skip


def count_words(text: str) -> int:
    return len(re.findall(r"[A-Za-z0-9']+", text))


def closeness(text: str, target: int) -> float:
    n = count_words(text)
    return max(0.0, 1.0 - abs(n - target) / target) if n else 0.0


def budget_score(replies: list[str], targets: list[int]) -> float:
    """Mean closeness of each turn's reply to its word budget (a missing reply counts 0)."""
    return sum(closeness(t, n) for t, n in zip(replies, targets, strict=False)) / len(targets)


def rows(count: int, seed: int) -> list[dict]:
    """The classic example's rows (prompt messages, `info` with topics and targets)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        first, second = rng.sample(TOPICS, 2)
        targets = [rng.randint(3, 8), rng.randint(3, 8)]
        prompt = [{"role": "user", "content": f"Describe {first} in exactly {targets[0]} words."}]
        out.append({"prompt": prompt, "info": {"topics": [first, second], "targets": targets}})
    return out


class Budgets(BaseModel):
    topics: list[str]
    """The topic of each turn."""
    targets: list[int]
    """The word budget of each turn."""


class WordBudgetData(vf.TaskData):
    info: Budgets


class WordBudgetTask(vf.Task[WordBudgetData, vf.State]):
    @vf.reward(weight=1.0)
    async def word_budget(self, trace: vf.Trace) -> float:
        said = [m.content or "" for m in trace.assistant_messages]
        return budget_score(said, self.data.info.targets)


class WordBudgetConfig(vf.TasksetConfig):
    num_train: int = 400
    """How many tasks to build."""
    seed: int = 0
    """The rows' seed."""


class WordBudgetTaskset(vf.Taskset[WordBudgetTask, WordBudgetConfig]):
    def load(self) -> list[WordBudgetTask]:
        return [
            WordBudgetTask(WordBudgetData.model_validate({"idx": i, **row}), self.config.task)
            for i, row in enumerate(rows(self.config.num_train, self.config.seed))
        ]


class WordBudgetEnv(vf.SingleAgentEnv):
    """The first reply, the second question, the second reply; an empty first reply ends
    the episode (the classic environment stops there)."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            first = await interaction.turn()
            if first.terminated or not _replied(first):
                return
            info = task.data.info
            await interaction.turn(
                f"Now describe {info.topics[1]} in exactly {info.targets[1]} words."
            )


def _replied(segment: vf.Segment) -> bool:
    replies = [m for m in segment.messages if isinstance(m, vf.AssistantMessage)]
    return bool(replies and replies[-1].content)

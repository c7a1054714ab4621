"""A verifiers environment for tests (loaded by id `verifiers_test_env`): two turns, an
observation between them, a group-level metric, and an env_response that can fail.

`env_response` sleeps a little so the episodes of a group overlap in time if (and only
if) they run concurrently, and raises for its first `fail_first` calls (counted across
instances) to play an environment that breaks.
"""

from __future__ import annotations

import asyncio
import itertools

import verifiers.legacy as vf
from datasets import Dataset

CALLS = itertools.count()  # env_response calls in this process


def length_reward(completion) -> float:
    """Any reward with variance: the replies' total length, mod 5."""
    text = "".join(str(m.content or "") for m in completion if m.role == "assistant")
    return float(len(text) % 5)


def group_size_seen(completions) -> list[float]:
    """A group-level metric: how many episodes the rubric's group call saw."""
    return [float(len(completions))] * len(completions)


class ObservationEnv(vf.MultiTurnEnv):
    def __init__(self, fail_first: int, **kwargs):
        super().__init__(**kwargs)
        self.fail_first = fail_first

    async def env_response(self, messages, state, **kwargs):
        if next(CALLS) < self.fail_first:
            raise RuntimeError("the environment broke")
        await asyncio.sleep(0.1)
        return [{"role": "user", "content": "observation: 42"}]


def load_environment(fail_first: int = 0, size: int = 20, eval_size: int = 2):
    prompts = [f"say {w}" for w in ("a", "b", "c", "d", "e")]
    rows = [
        {"prompt": [{"role": "user", "content": prompts[i % 5]}], "answer": str(i)}
        for i in range(size)
    ]
    rubric = vf.Rubric(funcs=[length_reward, group_size_seen], weights=[1.0, 0.0])
    return ObservationEnv(
        fail_first,
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows[:eval_size]) if eval_size else None,
        rubric=rubric,
        max_turns=2,
    )

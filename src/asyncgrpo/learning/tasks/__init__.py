"""Built-in tasks: prompt generators and their reward functions, by name.

Every generator is deterministic for a seed, needs no download, and returns up to
`count` distinct rows (fewer when its space of distinct prompts is smaller); the
rows carry the columns their reward functions read. The tasks are sized for a
135M model on a CPU: one-line prompts, answers of a few tokens. Which of them
the model can learn quickly was chosen by measuring base rates first, since a
group whose samples all score alike teaches GRPO nothing
(`benchmarks/base_rate.py`; SmolLM2-135M-Instruct, bf16 engine, 32 held-out
prompts x 8 samples at temperature 1, plus one greedy answer each):

| task (reward)                        | sampled | greedy | groups with variance | tokens |
|--------------------------------------|---------|--------|----------------------|--------|
| word_count (word_count_reward)       | 0.27    | 0.24   | 100%                 | 17.6   |
| arithmetic (short_arithmetic_reward) | 0.10    | 0.58   | 84%                  | 14.0   |
| repeat_word (repeat_word_reward)     | 0.09    | 0.20   | 97%                  | 14.0   |

`word_count` is the default recipe's task: low greedy reward, signal in every
group, and a behaviour (stopping on time) that GRPO moves in a few steps. The
strict arithmetic pair (`arithmetic_reward` + `number_only_reward`) is nearly
flat: a bare number is sampled in under 2% of completions.

Reward functions have TRL's signature `f(prompts, completions, completion_ids,
**columns) -> list[float | None]` and accept completions as strings or as TRL's
conversational `[{"role": "assistant", "content": ...}]`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from asyncgrpo.learning.tasks.arithmetic import (
    arithmetic_reward,
    arithmetic_rows,
    number_only_reward,
    short_arithmetic_reward,
)
from asyncgrpo.learning.tasks.calculator import calculator_answer_reward, calculator_rows
from asyncgrpo.learning.tasks.repeat import repeat_word_reward, repeat_word_rows
from asyncgrpo.learning.tasks.word_count import word_count_reward, word_count_rows

TASKS: dict[str, Callable[..., list[dict]]] = {
    "arithmetic": arithmetic_rows,
    "word_count": word_count_rows,
    "repeat_word": repeat_word_rows,
    "calculator": calculator_rows,  # a tool-use task: recipes/calculator.yaml (agent rollout)
}
"""Generators `f(count, seed, **task_kwargs) -> list[dict]` by task name."""

REWARDS: dict[str, Callable] = {
    "arithmetic_reward": arithmetic_reward,
    "short_arithmetic_reward": short_arithmetic_reward,
    "number_only_reward": number_only_reward,
    "word_count_reward": word_count_reward,
    "repeat_word_reward": repeat_word_reward,
    "calculator_answer_reward": calculator_answer_reward,
}
"""Reward functions by name (the names recipes use in `rewards:`)."""


def _closest(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f"did you mean '{close[0]}'?" if close else f"known: {', '.join(sorted(names))}"


def make_rows(name: str, count: int, seed: int, **kwargs) -> list[dict]:
    """Rows of the built-in task `name`; a bad name or keyword is a clear ValueError."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task '{name}'; {_closest(name, TASKS)}")
    try:
        return TASKS[name](count, seed, **kwargs)
    except TypeError as exc:
        raise ValueError(f"built-in task '{name}': {exc}") from None


def get_reward(name: str) -> Callable:
    """The built-in reward function `name`; an unknown name suggests the closest one."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward function '{name}'; {_closest(name, REWARDS)}")
    return REWARDS[name]


__all__ = ["REWARDS", "TASKS", "get_reward", "make_rows"]

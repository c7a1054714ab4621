"""A two-turn verifiers environment (classic API) with a group-level rubric term.

Written as a verifiers user writes one, knowing nothing of asyncgrpo: a module with
`load_environment(**kwargs)` returning a `MultiTurnEnv`, its dataset built in code.
`asyncgrpo train recipes/verifiers_word_budget.yaml` (from the repository root) loads it
by id (`examples.verifiers_word_budget`) and trains on it unchanged.

The task, word budgets over two turns: "Describe cats in exactly 4 words." — the model
replies — "Now describe the sea in exactly 6 words." — the model replies. The rubric:

- `word_budget` (weight 1): for each turn, 1 - |words - target| / target, floored at 0,
  averaged over the two turns (a missing reply counts 0). Dense, so almost every group
  has reward variance, and what it teaches (stopping on time) a 135M model picks up in
  a few steps (asyncgrpo's single-turn `word_count` task moves within 10 steps).
- `shortest_exact_bonus` (weight 0.5), a group-level function (it takes `completions`
  and `infos`, so verifiers scores it over the whole group at once): 1 for the episode(s)
  of the group that hit both budgets exactly with the fewest characters in total, 0 for
  the others. No single rollout can compute it: it needs its siblings.

Measured (recipes/verifiers_word_budget.yaml, 20 steps on 2 shared CPU cores): held-out
reward 0.36 at step 0 -> 0.83 at step 20 (word_budget 0.36 -> 0.73; the group bonus
0.00 -> 0.22 of episodes).
"""

from __future__ import annotations

import random
import re

try:  # verifiers 0.3.x keeps the classic API in verifiers.legacy
    import verifiers.legacy as vf
except ImportError:  # verifiers < 0.3: the classic API is the top level
    import verifiers as vf

TOPICS = (
    "cats", "dogs", "the sea", "rain", "coffee", "music", "trees", "the moon", "bread",
    "winter", "trains", "birds", "books", "snow", "the sun", "apples", "rivers", "friends",
    "summer", "mountains", "tea", "cities", "flowers", "clouds", "horses", "fire", "stars",
)  # fmt: skip


def _field(message, name: str):
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def replies(completion) -> list[str]:
    """The assistant replies of a completion, as text."""
    return [str(_field(m, "content") or "") for m in completion if _field(m, "role") == "assistant"]


def count_words(text: str) -> int:
    return len(re.findall(r"[A-Za-z0-9']+", text))


def closeness(text: str, target: int) -> float:
    n = count_words(text)
    return max(0.0, 1.0 - abs(n - target) / target) if n else 0.0


def word_budget(completion, info) -> float:
    """Mean closeness of each turn's reply to its word budget."""
    said = replies(completion)
    targets = info["targets"]
    return sum(closeness(t, n) for t, n in zip(said, targets, strict=False)) / len(targets)


def shortest_exact_bonus(completions, infos) -> list[float]:
    """1 for the group's exact episodes with the fewest characters, 0 for the others."""
    lengths = []
    for completion, info in zip(completions, infos, strict=True):
        said = replies(completion)
        exact = len(said) == len(info["targets"]) and all(
            count_words(t) == n for t, n in zip(said, info["targets"], strict=True)
        )
        lengths.append(sum(len(t) for t in said) if exact else None)
    best = min((n for n in lengths if n is not None), default=None)
    return [1.0 if n is not None and n == best else 0.0 for n in lengths]


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        first, second = rng.sample(TOPICS, 2)
        targets = [rng.randint(3, 8), rng.randint(3, 8)]
        out.append(
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Describe {first} in exactly {targets[0]} words.",
                    }
                ],
                "answer": "",
                "info": {"topics": [first, second], "targets": targets},
            }
        )
    return out


class WordBudgetEnv(vf.MultiTurnEnv):
    """Two turns: the second user message asks for the second topic's budget."""

    async def env_response(self, messages, state, **kwargs):
        topic, target = state["info"]["topics"][1], state["info"]["targets"][1]
        return [{"role": "user", "content": f"Now describe {topic} in exactly {target} words."}]


def load_environment(num_train: int = 400, num_eval: int = 16, seed: int = 0, **kwargs):
    from datasets import Dataset

    rubric = vf.Rubric(funcs=[word_budget, shortest_exact_bonus], weights=[1.0, 0.5])
    return WordBudgetEnv(
        dataset=Dataset.from_list(rows(num_train, seed)),
        eval_dataset=Dataset.from_list(rows(num_eval, seed + 1)),
        rubric=rubric,
        max_turns=2,
        **kwargs,
    )

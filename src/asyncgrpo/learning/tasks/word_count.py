"""Length control: "Describe cats in exactly 4 words."

A dense reward (closeness to the requested word count) gives almost every group
some variance, so every step has signal; what it teaches — stopping on time —
is visible in the completion-length curve as well as in the reward.
"""

from __future__ import annotations

import itertools
import random

from asyncgrpo.learning.tasks._common import completion_text, user_prompt, words

TOPICS = (
    "cats", "dogs", "the sea", "rain", "coffee", "music", "trees", "the moon", "bread",
    "winter", "trains", "birds", "books", "snow", "the sun", "apples", "rivers", "friends",
    "summer", "mountains", "tea", "cities", "flowers", "clouds", "horses", "fire", "stars",
    "gardens", "boats", "school",
)  # fmt: skip


def word_count_rows(count: int, seed: int, min_words: int = 3, max_words: int = 8) -> list[dict]:
    """Up to `count` distinct (topic, word count) prompts in a seeded order."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words; got {min_words}, {max_words}")
    space = list(itertools.product(TOPICS, range(min_words, max_words + 1)))
    random.Random(seed).shuffle(space)
    return [
        {
            "prompt": user_prompt(f"Describe {topic} in exactly {n} words."),
            "num_words": n,
            "task": "word_count",
        }
        for topic, n in space[:count]
    ]


def word_count_reward(prompts, completions, completion_ids=None, *, num_words, **columns):
    """1 - |words - target| / target, floored at 0: 1.0 for the exact count, partial credit
    for near misses, 0.0 at twice the target or for an empty reply."""
    scores = []
    for completion, target in zip(completions, num_words, strict=True):
        n = len(words(completion_text(completion)))
        scores.append(max(0.0, 1.0 - abs(n - int(target)) / int(target)) if n else 0.0)
    return scores

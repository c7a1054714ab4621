"""Instruction following: "Repeat the word 'apple' exactly 3 times."

Rewards the exact output ("apple apple apple", any case or punctuation) and gives
half credit when the word appears the right number of times among other words.
"""

from __future__ import annotations

import itertools
import random

from asyncgrpo.tasks._common import completion_text, user_prompt, words

WORDS = (
    "apple", "river", "green", "house", "music", "stone", "cloud", "table", "light", "paper",
    "tiger", "bread", "chair", "ocean", "smile", "plant", "water", "horse", "night", "sugar",
)  # fmt: skip
_NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five"}


def repeat_word_rows(count: int, seed: int, min_times: int = 2, max_times: int = 4) -> list[dict]:
    """Up to `count` distinct (word, times) prompts in a seeded order (times in 2..5)."""
    if not 2 <= min_times <= max_times <= 5:
        raise ValueError(f"need 2 <= min_times <= max_times <= 5; got {min_times}, {max_times}")
    space = list(itertools.product(WORDS, range(min_times, max_times + 1)))
    random.Random(seed).shuffle(space)
    return [
        {
            "prompt": user_prompt(
                f"Repeat the word '{word}' exactly {_NUMBERS[times]} times and nothing else."
            ),
            "word": word,
            "times": times,
            "task": "repeat_word",
        }
        for word, times in space[:count]
    ]


def repeat_word_reward(prompts, completions, completion_ids=None, *, word, times, **columns):
    """1.0: the reply is the word exactly `times` times and nothing else; 0.5: the word
    appears exactly `times` times among other words; 0.0 otherwise."""
    scores = []
    for completion, w, k in zip(completions, word, times, strict=True):
        found = words(completion_text(completion))
        if found == [w] * int(k):
            scores.append(1.0)
        else:
            scores.append(0.5 if found.count(w) == int(k) else 0.0)
    return scores

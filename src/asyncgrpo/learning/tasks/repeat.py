"""Instruction following: "Write the word apple three times, separated by spaces."

Full reward for the exact output ("apple apple apple", any case or punctuation),
partial credit for the right word at a near count. SmolLM2-135M-Instruct is
poor at this (it explains the word instead of repeating it; the exact output
comes in ~1-3% of samples), so it is the hard task of the three: useful to
see whether a longer run or a lower temperature finds the behaviour.
"""

from __future__ import annotations

import itertools
import random

from asyncgrpo.learning.tasks._common import completion_text, user_prompt, words

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
                f"Write the word {word} {_NUMBERS[times]} times, separated by spaces."
            ),
            "word": word,
            "times": times,
            "task": "repeat_word",
        }
        for word, times in space[:count]
    ]


def repeat_word_reward(prompts, completions, completion_ids=None, *, word, times, **columns):
    """1.0 for exactly the word `times` times and nothing else. Otherwise partial credit:
    closeness of the word's count to `times` (1 - |count - times| / times, floored at 0),
    halved when other words are present; 0.0 when the word is missing. Dense on purpose:
    the base model almost never gets the exact output (base rates in the module docstring)."""
    scores = []
    for completion, w, k in zip(completions, word, times, strict=True):
        found, k = words(completion_text(completion)), int(k)
        closeness = max(0.0, 1.0 - abs(found.count(w) - k) / k) if w in found else 0.0
        scores.append(closeness if all(x == w for x in found) else 0.5 * closeness)
    return scores

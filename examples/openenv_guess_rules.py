"""The rules of examples/openenv_guess.py that the trainer also needs, without OpenEnv.

`secret_for(seed)` is the secret a seed picks (the server's reset draws it with this);
`last_guess_right` grades an episode's final reply for `recipes/openenv_guess.yaml`'s
`rewards:`, a metric only (`final_last_guess_right`): the episode's reward is the
environment's. Kept apart from the server so that grading imports no server code.
"""

from __future__ import annotations

import json
import random
import re

HIGHEST = 16
_GUESS = re.compile(r'"number"\s*:\s*(-?\d+)')


def secret_for(seed: int | None) -> int:
    return random.Random(seed).randint(1, HIGHEST)


def last_guess_right(completions: list, seed: list[int], **kwargs) -> list[float]:
    """1.0 when the last number guessed in the final reply is the row's secret."""
    scores = []
    for completion, row_seed in zip(completions, seed, strict=True):
        text = completion if isinstance(completion, str) else json.dumps(completion)
        guesses = _GUESS.findall(text)
        scores.append(float(bool(guesses) and int(guesses[-1]) == secret_for(row_seed)))
    return scores

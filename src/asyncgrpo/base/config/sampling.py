"""How a single-turn rollout samples: one typed object from the recipe to the request.

`RolloutConfig.sampling` builds it once from the recipe's `rollout:` section (and the
run's seed); the group builder keeps it, and `request_fields` is the one place that
turns it into the fields of an OpenAI-style completion request (`n`, `max_tokens`,
`temperature`, `top_p`, `seed`), which `EngineClient.complete` takes as keywords and
sends as the request body. On the engine's side the body is parsed into
`SamplingParams`; that is the HTTP boundary, not another form of the same settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SEED_SPACE = 2**31  # request seeds stay in a signed 32-bit int, as every engine accepts


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """The sampling of one group's request, as the recipe configures it."""

    n: int
    """Completions per prompt (`rollout.num_generations`)."""
    max_tokens: int
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy); the trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling cut-off."""
    seed: int | None = None
    """The run's seed, from which each group's request seed derives (None: unseeded)."""
    max_prompt_length: int | None = None
    """Keep only the prompt's last this many ids (None: the whole prompt)."""

    def request_fields(self, group_id: int | None = None) -> dict[str, Any]:
        """The completion request's sampling fields; seeded per group when the run has a
        seed and `group_id` is given (a fixed seed then repeats a run)."""
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.seed is not None and group_id is not None:
            fields["seed"] = (self.seed * 7919 + group_id) % SEED_SPACE
        return fields

    def continuing(self, generated: int) -> SamplingSettings:
        """One sample's continuation after `generated` tokens (a sync aborted it)."""
        return dataclasses.replace(self, n=1, max_tokens=self.max_tokens - generated)

    def greedy(self) -> SamplingSettings:
        """One greedy completion of the same length (held-out evaluation)."""
        return dataclasses.replace(self, n=1, temperature=0.0, top_p=1.0, seed=None)

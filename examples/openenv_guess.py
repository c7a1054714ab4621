"""Guess the number: a small OpenEnv environment server, trained by `recipes/openenv_guess.yaml`.

Written with OpenEnv's own server pieces (`Environment`, typed `Action` / `Observation`,
`create_app`), the way an OpenEnv user writes one; asyncgrpo serves it with uvicorn
(`agent.openenv.app: examples.openenv_guess:app`) and plays one WebSocket session per
episode. Run it alone with `uvicorn examples.openenv_guess:app --port 8000` and point a
recipe at it with `agent.openenv.url: http://127.0.0.1:8000` instead.

The game: `reset(seed)` picks a secret from 1 to `HIGHEST` (the seed decides it, so the
episodes of a GRPO group play the same secret); each `guess(number)` is one step, answered
`higher`, `lower` or `correct`. The episode ends at the right guess or after `MAX_GUESSES`
wrong ones. Its rewards add up to the score of the best guess: 1.0 for the secret at the
first guess, 0.1 less per guess before it; a wrong guess 0.5 * (1 - distance / 15), so
guessing closer pays before finding pays (each step's reward is its improvement on the
best guess so far). Measured with only the finding reward (1.0 less 0.1 per extra guess,
else 0): SmolLM2 often made one guess, then answered in words; the first 32 groups all
scored 0 (zero variance) and the run stopped after 132 s with nothing to learn. A number outside 1..HIGHEST fails the action's validation (a tool error the
model reads, not a step). Random distinct guesses find the secret 6 times in 16;
following the feedback (halving) always does, within 4 guesses.

Sessions are independent (all state lives on the instance), so the class says
`SUPPORTS_CONCURRENT_SESSIONS = True` and the app allows 64 sessions at once: a group of 8
episodes needs 8, and a run keeps several groups in flight.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

from examples.openenv_guess_rules import HIGHEST, secret_for

MAX_GUESSES = 6
MAX_SESSIONS = 64


class GuessAction(Action):
    """Guess the secret number; the answer says whether it is higher, lower or correct."""

    number: int = Field(ge=1, le=HIGHEST, description=f"your guess, from 1 to {HIGHEST}")


class GuessObservation(Observation):
    message: str = Field(description="what the game master says")


class GuessState(State):
    secret: int = 0
    guesses: list[int] = Field(default_factory=list)
    best: float = 0.0  # the best score of a guess so far (what the rewards add up to)


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = GuessState()

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        secret = secret_for(seed)
        self._state = GuessState(episode_id=episode_id, secret=secret)
        return GuessObservation(
            message=(
                f"I picked a whole number from 1 to {HIGHEST}. Find it with the guess tool: "
                f"after each guess I say higher, lower or correct. You have {MAX_GUESSES} "
                "guesses."
            )
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any):
        state = self._state
        state.step_count += 1
        state.guesses.append(action.number)
        left = MAX_GUESSES - len(state.guesses)
        if action.number == state.secret:
            found = 1.0 - 0.1 * (len(state.guesses) - 1)
            return self._observe("correct", found, done=True)
        hint = "higher" if state.secret > action.number else "lower"
        # a wrong guess scores its closeness, 0.5 * (1 - distance / 15), and a step pays
        # what it improves on the best guess so far: the rewards add up to the best one's
        close = 0.5 * (1 - abs(action.number - state.secret) / (HIGHEST - 1))
        if left == 0:
            return self._observe(f"{hint}; no guesses left, it was {state.secret}", close, True)
        return self._observe(f"{hint} ({left} left)", close, done=False)

    def _observe(self, message: str, score: float, done: bool) -> GuessObservation:
        """The observation paying the step's improvement on the best score so far."""
        gain = max(score - self._state.best, 0.0)
        self._state.best = max(self._state.best, score)
        return GuessObservation(message=message, done=done, reward=round(gain, 4))

    @property
    def state(self) -> GuessState:
        return self._state


app = create_app(
    GuessEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess_number",
    max_concurrent_envs=MAX_SESSIONS,
    state_cls=GuessState,
)

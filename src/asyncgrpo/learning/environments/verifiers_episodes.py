"""One verifiers rollout per episode, and the rubric's group call over a finished group.

Split from `environments/verifiers.py` (loading, rows, sampling): this is what runs per
episode and per group. The decisions (what fails how, what the reward columns are)
are in that module's docstring.
"""

from __future__ import annotations

import math
from typing import Any

from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, EnvironmentFailure, Result


class VerifiersRollout:
    """`async (task, llm) -> Result`: the environment's own turn loop on the episode's URL.

    The returned `Result` has no reward (the group's rubric call gives it) and the
    rollout's verifiers `State` as its context.
    """

    def __init__(self, vf: Any, env: Any, sampling: dict[str, Any]):
        self.vf, self.env, self.sampling = vf, env, sampling

    async def __call__(self, task: dict, llm: LLM) -> Result:
        oai = llm.client()
        wrapper = getattr(self.vf, "OpenAIChatCompletionsClient", None)  # 0.3.x: vf.Client
        client = wrapper(oai) if wrapper is not None else oai
        try:
            state = await self.env.rollout(dict(task), client, llm.model, dict(self.sampling))
        except Exception as exc:
            _raise_transport(exc)
            raise EnvironmentFailure(
                f"the verifiers environment raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            await oai.close()
        return self.ending(state)

    def ending(self, state: Any) -> Result:
        """How the rollout ended, from its state (see the module docstring of `verifiers`)."""
        info: dict[str, Any] = {}
        error = state.get("error")
        stop = StopReason.OK
        if error is not None:
            if _gateway_refused_turn(error):
                stop = StopReason.MAX_TURNS
            else:
                _raise_transport(error)
                if isinstance(error, self.vf.InfraError):
                    raise EnvironmentFailure(f"verifiers InfraError: {error}") from error
                info["verifiers_error"] = type(error).__name__
        if state.get("timed_out"):
            stop = StopReason.TIMEOUT
        elif state.get("prompt_too_long") or state.get("is_truncated"):
            stop = StopReason.LENGTH
        # the environment's own stop conditions (its max_turns included: a SingleTurnEnv
        # always reaches it) end the episode `ok`; `max_turns` is the gateway's refusal
        return Result(None, stop, info=info, context=state)


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _raise_transport(exc: BaseException) -> None:
    """Re-raise the gateway's own error under `exc`, if any, so the runner classifies it
    (unreachable or 5xx: infra_error; 413: length; another 4xx: tool_error)."""
    import openai

    for cause in _causes(exc):
        if isinstance(cause, openai.APIConnectionError | openai.APIStatusError):
            raise cause
        if isinstance(cause, ConnectionError):
            raise cause


def _gateway_refused_turn(exc: BaseException) -> bool:
    """The gateway's 400 for a call past `agent.max_turns`."""
    import openai

    return any(
        isinstance(c, openai.BadRequestError) and "max_turns" in str(c) for c in _causes(exc)
    )


class RubricScorer:
    """The environment's rubric over a finished group: one `rubric` column, the rubric's
    weighted total; per-function values go to each episode's info as `rubric_<name>`."""

    names = ["rubric"]  # noqa: RUF012 - the GroupScorer protocol's attribute

    def __init__(self, env: Any):
        self.env = env

    async def score(self, row: dict, outcomes: list) -> list[list[float | None]]:
        states = [o.context for o in outcomes]
        scored = [s for s in states if s is not None]
        if scored:
            await self.env.rubric.score_group(scored)
            for state in scored:
                await self.env.rubric.cleanup(state)
        out: list[list[float | None]] = []
        for outcome, state in zip(outcomes, states, strict=True):
            if state is None:
                out.append([None])
                continue
            for name, value in (state.get("metrics") or {}).items():
                if isinstance(value, int | float) and math.isfinite(value):
                    outcome.info[f"rubric_{name}"] = float(value)
            reward = state.get("reward")
            out.append([None if reward is None else float(reward)])
        return out

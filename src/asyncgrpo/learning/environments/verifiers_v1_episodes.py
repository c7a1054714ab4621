"""One verifiers 0.4 episode per asyncgrpo episode, how it ended, and its reward columns.

The rollout hands the row's task to the environment's host (`verifiers_v1_host`), which
runs `Env.run_episode` on it against the episode's gateway: verifiers drives the agent
(setup, the harness's turns, `@stop`s and limits, finalize) and scores each trace with the
task's rewards, so the rewards are on the returned `Episode` when the rollout returns. The
trained tokens are the gateway's record of the engine's own, whatever verifiers' trace
says; messages the environment, a tool or a user turn added carry no loss.

How an episode ends (`ending`), from verifiers' record of it:

- every trace `ok`: stop reason `ok`, or `max_turns` (verifiers' `max_turns` limit, which
  is `agent.max_turns`), or `length` (a token limit, a reply cut by `max_tokens`, a prompt
  the context could not hold); scored;
- a stage deadline of verifiers or of the env (`timeout`);
- a model call that failed: the gateway's status decides, as for any agent (unreachable, a
  5xx, an expired episode: `infra_error`; a prompt over the context: `length`; another
  refusal: `tool_error`);
- a reward or metric that raised (`scoring`): `reward_error`, masked;
- anything else that failed — the task's `setup`/`finalize`, a tool server, the runtime,
  the harness, the env's own `run`/`finalize` — is the environment's failure:
  `EnvironmentFailure`, so the episode is `infra_error`, run again, never scored 0.

The reward columns (`V1Rewards`) are the task's reward names, each the score verifiers
recorded (`trace.rewards[name].score`; the weights apply in the run's reward sum). An
episode with several trainable traces (a multi-agent env) gets each column's mean over
them. A reward recorded under a name the task does not declare (a reward returning a
mapping of several scores, an `Env.finalize` recording its own) drops the group as a
`reward_error` naming it: asyncgrpo needs its reward columns before the run starts.
Each trace's metrics and scores are also in the episode's info (`metric_<name>`,
`score_<name>`; evaluations log `eval_metric_<name>`, `eval_score_<name>`).
"""

from __future__ import annotations

import math
from typing import Any

from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, EnvironmentFailure, Result, RewardError

LENGTH_STOPS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")


class V1Rollout:
    """`async (row, llm) -> Result`: the row's task, one verifiers episode on `llm`."""

    def __init__(self, host: Any, book: Any):
        self.host, self.book = host, book

    async def __call__(self, row: dict, llm: LLM) -> Result:
        episode = await self.host.episode(self.book.task_of(row), llm)
        return ending(episode)


def trainable_traces(episode: Any) -> list:
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    return traces or list(episode.traces)


def ending(episode: Any) -> Result:
    """How the episode ended (see the module docstring); raises for the environment's
    failure (`EnvironmentFailure`) and a failed reward (`RewardError`)."""
    failed = [t for t in episode.traces if not t.ok]
    if episode.errors or failed:
        error = (episode.errors or failed[0].errors or [None])[-1]
        if episode.is_timeout or any(t.is_timeout for t in failed):
            return Result(None, StopReason.TIMEOUT, info=_info(episode), context=episode)
        return Result(None, _failure(error), info=_info(episode), context=None)
    traces = trainable_traces(episode)
    stop = StopReason.OK
    if any(t.is_timeout for t in traces):
        stop = StopReason.TIMEOUT
    elif any(t.stop_condition == "max_turns" for t in traces):
        stop = StopReason.MAX_TURNS
    elif any(_cut(t) for t in traces):
        stop = StopReason.LENGTH
    failures = sum(int(t.info.get("tool_failures", 0)) for t in traces)
    return Result(None, stop, tool_failures=failures, info=_info(episode), context=episode)


def _cut(trace: Any) -> bool:
    """A token limit, a reply cut by max_tokens, or a last call refused as too long."""
    if trace.is_truncated or trace.stop_condition in LENGTH_STOPS:
        return True
    last = trace.calls[-1] if trace.calls else None
    return last is not None and last.error is not None and _too_long(last.error)


def _too_long(error: Any) -> bool:
    message = (error.message or "").lower()
    return error.status_code == 413 or (error.status_code == 400 and "max_model_len" in message)


def _failure(error: Any) -> StopReason:
    """The stop reason of a failed episode's error, or raise (see the module docstring)."""
    kind = getattr(error, "type", "unknown error")
    message = getattr(error, "message", "")
    status = getattr(error, "status_code", None)
    if kind == "ProviderError" and status is not None and 400 <= status < 500:
        if status in (401, 409, 429):  # an expired or closed episode; throttled
            raise EnvironmentFailure(f"the gateway refused a call ({status}): {message}")
        if _too_long(error):
            return StopReason.LENGTH
        if status == 400 and "max_turns" in message:
            return StopReason.MAX_TURNS
        return StopReason.TOOL_ERROR
    if kind == "ProviderError":
        raise EnvironmentFailure(f"a model call failed ({status}): {message}")
    if kind == "TaskError" and "scoring" in message:
        raise RewardError(f"the environment's rewards failed: {message}")
    raise EnvironmentFailure(f"the verifiers environment failed: {kind}: {message}")


def _info(episode: Any) -> dict[str, float]:
    info: dict[str, float] = {}
    traces = trainable_traces(episode)
    for trace in traces:
        for name, value in trace.metrics.items():
            _add(info, f"metric_{name}", value, len(traces))
        for name, reward in trace.rewards.items():
            _add(info, f"score_{name}", None if reward is None else reward.score, len(traces))
    return info


def _add(info: dict[str, float], key: str, value: Any, count: int) -> None:
    if isinstance(value, int | float) and math.isfinite(value):
        info[key] = info.get(key, 0.0) + float(value) / count


class V1Rewards:
    """The reward columns of finished episodes (see the module docstring)."""

    def __init__(self, names: list[str]):
        self.names = names

    async def score(self, row: dict, outcomes: list) -> list[list[float | None]]:
        return [self.columns(o.context) for o in outcomes]

    def columns(self, episode: Any) -> list[float | None]:
        if episode is None:
            return [None] * len(self.names)
        traces = trainable_traces(episode)
        unknown = sorted({n for t in traces for n in t.rewards} - set(self.names))
        if unknown:
            raise ValueError(
                f"rewards {unknown} were recorded beside the declared {self.names}: "
                "declare each as a @vf.reward of the task (one score per function)"
            )
        out: list[float | None] = []
        for name in self.names:
            scores = [t.rewards[name].score for t in traces if t.rewards.get(name) is not None]
            scores = [s for s in scores if math.isfinite(s)]
            out.append(sum(scores) / len(scores) if scores else None)
        return out
